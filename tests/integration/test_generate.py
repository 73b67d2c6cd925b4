"""`make generate` on the session's export: every row once with the id, text, token ids and lineage; per-row
settings; kill -9 halfway then a rerun equals an uninterrupted run (greedy and seeded rows); the Ray Data path and a
Parquet table give the same rows."""
import json
import os
import signal
import subprocess
import sys

import pytest

from helpers import cli, env_for, wait_until
from core import REPO_ROOT

pytestmark = pytest.mark.slow

ROWS = 240
WORDS = ("人工智能", "这本书", "快递很快，", "今天天气", "我们的", "中国")


@pytest.fixture(scope="module")
def table(exported, tmp_path_factory):
    """Mixed rows: greedy, seeded sampling (top_k / top_p), stop strings, logprobs, ids of several types, one row the
    protocol refuses; and the uninterrupted local run's output."""
    root = tmp_path_factory.mktemp("generate")
    rows = []
    for i in range(ROWS):
        row = {"id": f"row-{i}" if i % 5 else i, "prompt": WORDS[i % 6] + WORDS[(i * 7) % 6],
               "max_new_tokens": 6 + i % 11, "note": "not read"}
        if i % 3 == 1:
            row.update(temperature=0.9, top_k=30, seed=i)
        elif i % 3 == 2:
            row.update(temperature=0.7, top_p=0.8, seed=1000 + i)
        if i % 8 == 0:
            row["stop"] = ["的", "。"]
        if i % 10 == 3:
            row["logprobs"] = 2
        rows.append(row)
    rows.append({"id": "too-many", "prompt": "中国", "max_new_tokens": 10_000})
    source = root / "prompts.jsonl"
    source.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    base = ["--config", str(exported["config"]), "--model", str(exported["export_dir"]), "--input", str(source)]
    reference = root / "reference.jsonl"
    proc = cli(["generate", *base, "--output", str(reference)], exported["uri"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {**exported, "rows": rows, "source": source, "base": base, "root": root,
            "reference": by_id(reference), "stderr": proc.stderr}


def same_rows(got: dict, expected: dict) -> None:
    """Equal rows; log-probabilities within float noise (a row's batch changes the logits' last bits, not tokens)."""
    assert got.keys() == expected.keys()
    for key, row in expected.items():
        other = dict(got[key])
        if "logprobs" in row:
            mine = other.pop("logprobs")
            assert mine["tokens"] == row["logprobs"]["tokens"], key
            assert mine["token_logprobs"] == pytest.approx(row["logprobs"]["token_logprobs"], abs=1e-4), key
        assert other == {k: v for k, v in row.items() if k != "logprobs"}, key


def by_id(path) -> dict:
    lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    ids = [json.dumps(line["id"]) for line in lines]
    assert len(ids) == len(set(ids)), "a row appears twice"
    return dict(zip(ids, lines))


def test_every_row_once_with_its_settings_and_lineage(table):
    out = table["reference"]
    assert len(out) == ROWS + 1
    refused = out[json.dumps("too-many")]
    assert "max_new_tokens" in refused["error"] and "text" not in refused
    for i, row in enumerate(table["rows"][:ROWS]):
        got = out[json.dumps(row["id"])]
        assert got["lineage"] == {"model_name": "test-model", "model_version": "1",
                                  "source_run_id": got["lineage"]["source_run_id"], "checkpoint_step": "12"}
        assert 1 <= len(got["token_ids"]) <= row["max_new_tokens"]
        assert got["finish_reason"] in ("stop", "length") and isinstance(got["text"], str)
        if "stop" in row:
            assert not any(s in got["text"] for s in row["stop"])
        assert ("logprobs" in got) == ("logprobs" in row)
        if "logprobs" in row:
            assert len(got["logprobs"]["top_logprobs"][0]) <= 2
    assert "generate: 241/241 rows (100.0%)" in table["stderr"] and "ETA" in table["stderr"]


def test_a_killed_run_resumes_without_duplicates_and_equals_an_uninterrupted_run(table):
    target = table["root"] / "resumed.jsonl"
    cmd = [sys.executable, "-m", "pipeline", "generate", *table["base"], "--output", str(target),
           "--workers", "1", "serving.generate_batch_size=2"]  # (slow enough to be killed halfway)
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env_for(table["uri"]), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    wait_until(lambda: proc.poll() is not None or (target.exists() and target.read_bytes().count(b"\n") >= ROWS // 3),
               120, 0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    written = target.read_bytes().count(b"\n")
    assert ROWS // 3 <= written < ROWS, written
    with open(target, "ab") as f:
        f.write(b'{"id": "row-1", "text": "cut sh')  # (a line a kill cut short: dropped on resume)
    again = cli(["generate", *table["base"], "--output", str(target)], table["uri"])
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"{ROWS + 1 - written:,} to generate" in again.stdout, again.stdout
    same_rows(by_id(target), table["reference"])
    nothing = cli(["generate", *table["base"], "--output", str(target)], table["uri"])
    assert "0 to generate" in nothing.stdout
    same_rows(by_id(target), table["reference"])


def test_the_ray_data_path_and_parquet_tables_give_the_same_rows(table):
    import pandas as pd

    frame = pd.DataFrame(table["rows"][:60]).astype({"id": str})
    source = table["root"] / "prompts.parquet"
    frame.to_parquet(source, index=False)
    target = table["root"] / "ray.parquet"
    proc = cli(["generate", "--config", str(table["config"]), "--model", str(table["export_dir"]), "--input",
                str(source), "--output", str(target), "--engine", "ray", "--workers", "2"], table["uri"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = pd.read_parquet(target).to_dict("records")
    assert len(got) == 60 and not (table["root"] / "ray.parquet.partial.jsonl").exists()
    for row in got:
        ident = row["id"]
        expected = table["reference"][json.dumps(int(ident) if ident.isdigit() else ident)]
        assert (row["text"], list(row["token_ids"]), row["finish_reason"]) == \
            (expected["text"], expected["token_ids"], expected["finish_reason"]), ident
        assert row["lineage"]["model_version"] == "1"
