"""The benchmark harness on a tiny setting (no timing is asserted anywhere), into a temp directory: the runtime section,
whose trials each run in a process of their own with their setting (the other sections drive verbs and servers that
their own tests cover; `make bench` runs them all)."""
import json

import pytest

from helpers import cli

pytestmark = pytest.mark.slow


def test_bench_harness_quick(store_uri, tmp_path):
    from core.workarounds import cpu_runtime
    proc = cli(["--quick", "--sections", "runtime", "--out", str(tmp_path)], store_uri, timeout=900, module="bench")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["quick"] is True and "serving" not in result and "scaling" not in result
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
    report = (tmp_path / "bench.md").read_text()
    assert "| threads+mkl+compile+passive+ops |" in report and "| before |" in report
