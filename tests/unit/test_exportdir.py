"""The export-directory contract (core/exportdir.py): what export writes is what serving reads. Fast, no paddle
graph needed (a fake weights file stands in for model.pdiparams)."""
import json

import pytest

from core import exportdir
from core.errors import ConfigError

META = {"registered_model_name": "m", "version": 3, "source_run_id": "r1", "checkpoint_step": 40,
        "eos_token_id": 3, "max_position_embeddings": 256, "vocab_size": 4608, "weights_sha256": ""}


def fake_export(root):
    root.mkdir()
    model, params = exportdir.graph_files(root)
    model.write_bytes(b"graph")
    params.write_bytes(b"weights")
    exportdir.tokenizer_dir(root).mkdir()
    exportdir.write_serving_conf(root, "input_ids", "linear_113.tmp_0", 4608)
    exportdir.write_meta(root, {**META, "weights_sha256": exportdir.weights_sha256(root)})
    return root


def test_meta_round_trip_and_completeness(tmp_path):
    root = fake_export(tmp_path / "e")
    assert exportdir.read_meta(root)["version"] == 3
    assert exportdir.is_complete(root)
    exportdir.graph_files(root)[1].write_bytes(b"other weights")  # a half-copied / replaced directory
    assert not exportdir.is_complete(root)


def test_serving_conf_names_the_graph_vars(tmp_path):
    root = fake_export(tmp_path / "e")
    assert exportdir.fetch_name(root) == "linear_113.tmp_0"
    text = (root / exportdir.SERVING_CONF).read_text()
    assert 'feed_var {\n  name: "input_ids"' in text and "  shape: 4608\n" in text
    assert f"feed_type: {exportdir.SERVING_TYPE_CODES['int64']}" in text
    assert f"fetch_type: {exportdir.SERVING_TYPE_CODES['float32']}" in text


def test_references_round_trip(tmp_path):
    root = fake_export(tmp_path / "e")
    assert exportdir.read_references(root) == {}  # an export made before references existed
    refs = {prompt: [10 + i, 11 + i] for i, prompt in enumerate(exportdir.REFERENCE_PROMPTS)}
    exportdir.write_references(root, refs)
    assert exportdir.read_references(root) == refs


def test_reading_what_is_not_an_export_says_so(tmp_path):
    with pytest.raises(ConfigError, match="is not an export directory"):
        exportdir.read_meta(tmp_path)
    (tmp_path / exportdir.META_FILE).write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        exportdir.read_meta(tmp_path)
    (tmp_path / exportdir.META_FILE).write_text(json.dumps({"version": 1}))
    with pytest.raises(ConfigError, match="lacks registered_model_name"):
        exportdir.read_meta(tmp_path)
    with pytest.raises(ValueError, match="missing"):
        exportdir.write_meta(tmp_path, {"version": 1})


def test_an_export_of_a_newer_format_is_refused_and_an_older_one_read(tmp_path):
    """Format 1 (no format_version: exports made before the fused decode program) is read; a format this checkout
    does not know is refused in one line naming the re-export."""
    root = fake_export(tmp_path / "e")
    assert exportdir.format_version(exportdir.read_meta(root)) == 1
    exportdir.write_meta(root, {**META, "format_version": exportdir.FORMAT_VERSION})
    assert exportdir.format_version(exportdir.read_meta(root)) == exportdir.FORMAT_VERSION == 4
    exportdir.write_meta(root, {**META, "format_version": exportdir.FORMAT_VERSION + 1})
    with pytest.raises(ConfigError, match=r"is export format 5; this checkout reads formats 1-4: update it, or "
                                          r"re-export the run with this checkout's `make export`"):
        exportdir.read_meta(root)
