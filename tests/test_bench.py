"""The benchmark harness runs end to end on a tiny setting (no timing is asserted anywhere)."""
import json

import pytest

from helpers import cli

pytestmark = pytest.mark.slow


def test_bench_harness_quick(store_uri):
    from pipeline import REPO_ROOT

    proc = cli(["bench", "--quick"], store_uri, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads((REPO_ROOT / "reports" / "bench" / "bench.json").read_text())
    assert result["quick"] is True
    for section in ("hardware", "training_efficiency", "scaling", "pipeline_overhead", "export", "serving"):
        assert section in result, section
    assert result["training_efficiency"]["fraction_of_peak"] > 0
    assert result["scaling"]["dp2"]["speedup_vs_single"] > 0
    assert [c["clients"] for c in result["serving"]["concurrency"]] == [1, 4, 8]
    assert all(c["errors"] == 0 for c in result["serving"]["concurrency"])
    assert "| matmul peak" in (REPO_ROOT / "reports" / "bench" / "bench.md").read_text()
