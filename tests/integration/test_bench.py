"""The benchmark harness runs end to end on a tiny setting (no timing is asserted anywhere), into a temp directory."""
import json

import pytest

from helpers import cli

pytestmark = pytest.mark.slow


def test_bench_harness_quick(store_uri, tmp_path):
    from core.workarounds import cpu_runtime
    proc = cli(["--quick", "--out", str(tmp_path)], store_uri, timeout=900, module="bench")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["quick"] is True
    for section in ("runtime", "scaling", "export", "serving"):
        assert section in result, section
    settings = result["runtime"]["settings"]
    assert list(settings) == ["before", "threads+mkl+compile+passive+ops"]  # quick: the two ends
    # each trial process really ran with its setting
    assert settings["before"]["runtime"]["threads"] == "1"
    assert settings["before"]["runtime"]["mkl_debug_cpu_type"] == "unset"
    assert settings["threads+mkl+compile+passive+ops"]["runtime"]["threads"] == str(cpu_runtime.available_cores())
    amd = cpu_runtime.cpu_vendor() == "AuthenticAMD"
    assert settings["threads+mkl+compile+passive+ops"]["runtime"]["mkl_debug_cpu_type"] == ("5" if amd else "unset")
    # OpenMP threads sleep between ops (KMP_BLOCKTIME=0) in the project's setting, spin as before in "before"
    assert (settings["before"]["runtime"]["kmp_blocktime"],
            settings["threads+mkl+compile+passive+ops"]["runtime"]["kmp_blocktime"]) == ("unset", "0")
    # PaddleNLP's own Llama ops before, the CPU replacements now (model/llama.py)
    assert (settings["before"]["runtime"]["cpu_llama_ops"],
            settings["threads+mkl+compile+passive+ops"]["runtime"]["cpu_llama_ops"]) == ("off", "on")
    for v in settings.values():
        assert 0 < v["mfu"]["median"] < 1
        assert v["mfu"]["min"] <= v["mfu"]["median"] <= v["mfu"]["max"]
    assert settings["before"]["speedup_vs_before"] == 1.0
    assert result["scaling"]["dp2"]["speedup_vs_single"] > 0
    plan = result["plan_vs_measured"]  # calibrated on single: its estimate is its measured step
    assert list(plan["layouts"]) == ["single", "dp2"] and 0 < plan["calibrated_utilisation"] < 1
    single = plan["layouts"]["single"]
    assert single["estimated_step_s"] == pytest.approx(single["measured_step_s"], rel=1e-9)
    assert single["measured_step_s"] == result["scaling"]["single"]["step_time_s"]
    serving = result["serving"]
    for scheduler in ("continuous", "static"):
        rows = serving[scheduler]["load"]
        assert [r["clients"] for r in rows] == [1, 4]  # quick: two concurrency levels
        assert all(r["errors"] == 0 and r["requests"] > 0 and r["tokens_per_s"] > 0 for r in rows), rows
        assert all(0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"] and r["tpot_p50_ms"] <= r["tpot_p99_ms"] for r in rows)
        assert serving[scheduler]["workers"] == cpu_runtime.available_cores()
        for route in ("http", "grpc", "openai"):
            assert serving[scheduler][f"{route}_overhead_p50_ms"] == pytest.approx(
                serving[scheduler][f"{route}_p50_ms"] - serving[scheduler]["in_process_p50_ms"])
    assert serving["continuous"]["load"][0]["vs_1_client"] == 1.0
    streaming = serving["continuous"]["streaming"]  # quick: 1 and 4 streaming clients
    assert [r["clients"] for r in streaming] == [1, 4] and all(r["errors"] == 0 and r["requests"] > 0 and
                                                              0 < r["ttft_p50_ms"] <= r["latency_p50_ms"]
                                                              for r in streaming), streaming
    assert serving["in_process"]["batch8_tokens_per_s"] > 0
    data = result["data"]  # quick: a 2,000-document slice of each corpus, one round, no rank runs
    for size in ("1x", "8x"):
        for variant in ("previous", "workers1", "workers2"):
            row = data[size][variant]
            assert row["mb_per_s"]["median"] > 0 and row["peak_rss_mb"]["median"] > 0, (size, variant)
        assert data[size]["workers2_vs_workers1"] == pytest.approx(
            data[size]["workers2"]["mb_per_s"]["median"] / data[size]["workers1"]["mb_per_s"]["median"])
    assert data["corpus_mb"]["8x"] == pytest.approx(8 * data["corpus_mb"]["1x"], rel=0.01)
    report = (tmp_path / "bench.md").read_text()
    assert "## Data preparation" in report and "| 8x | workers2 |" in report
    assert "| threads+mkl+compile+passive+ops |" in report and "| 4 | " in report and "Overhead over in process" in report
