"""CPU math runtime decisions (core/workarounds/cpu_runtime.py): fast, no training."""
import pytest

from core.workarounds import cpu_runtime
from core.config import ConfigError, load_config


@pytest.mark.parametrize("vendor, version, environ, expected", [
    ("AuthenticAMD", "2019.0.5", {}, "5"),                      # Paddle 2.6.2's MKL on AMD: fast kernels
    ("AuthenticAMD", "2020.0.4", {}, "5"),                      # last release that reads the switch
    ("AuthenticAMD", "2020.1", {}, None),                        # 2020.1 removed it: setting it would do nothing
    ("AuthenticAMD", "", {}, None),                              # no MKL (OpenBLAS / GPU build)
    ("GenuineIntel", "2019.0.5", {}, None),                      # harmful on Intel (measured 174 -> 104 GFLOP/s)
    ("AuthenticAMD", "2019.0.5", {"MKL_DEBUG_CPU_TYPE": "2"}, None),      # the user's own value wins
    ("AuthenticAMD", "2019.0.5", {"PIPELINE_MKL_AMD_FIX": "off"}, None),  # switched off (benchmarks)
])
def test_mkl_switch_decision(vendor, version, environ, expected):
    assert cpu_runtime.mkl_switch_value(vendor, version, environ) == expected


def test_bundled_mkl_version_is_read(monkeypatch):
    """The version comes from the library the installed Paddle ships (the CPU wheel of 2.6.2: MKL 2019.0.5; a build
    without MKL: ""), read without importing paddle, and is remembered for child processes."""
    import importlib.util
    import os
    import re
    from pathlib import Path

    monkeypatch.delenv("PIPELINE_MKL_VERSION", raising=False)
    bundled = (Path(importlib.util.find_spec("paddle").origin).parent / "libs" / "libmklml_intel.so").exists()
    version = cpu_runtime.mkl_version()
    assert re.fullmatch(r"20\d\d\.\d+(\.\d+)?", version) if bundled else version == "", version
    assert os.environ["PIPELINE_MKL_VERSION"] == version


@pytest.mark.parametrize("configured, processes, cores, expected", [
    (0, 1, 2, 2), (0, 2, 2, 1), (0, 4, 2, 1), (0, 2, 16, 8), (0, 3, 16, 5), (3, 2, 16, 3)])
def test_threads_per_process(configured, processes, cores, expected):
    assert cpu_runtime.threads_per_process(configured, processes, cores) == expected


def test_threads_override_must_fit_the_cores(monkeypatch):
    monkeypatch.setattr("core.workarounds.cpu_runtime.available_cores", lambda: 4)
    ok = load_config(None, ["parallel.data=2", "parallel.micro_batch_size=8", "parallel.cpu_threads=2"]).layout()
    ok.check_fits_machine()
    assert ok.threads_per_rank() == 2
    too_many = load_config(None, ["parallel.data=2", "parallel.micro_batch_size=8",
                               "parallel.cpu_threads=3"]).layout()
    with pytest.raises(ConfigError, match=r"2 processes x 3 threads = 6 > the 4 cores"):
        too_many.check_fits_machine()
    with pytest.raises(ConfigError, match="parallel.cpu_threads: must be >= 0"):
        load_config(None, ["parallel.cpu_threads=-1"])


def test_compile_refused_for_model_parallel_layouts():
    with pytest.raises(ConfigError, match="training.compile: the compiled forward supports single-device"):
        load_config(None, ["training.compile=true", "parallel.tensor=2"])
    load_config(None, ["training.compile=true", "parallel.data=2", "parallel.micro_batch_size=8"])


def test_openmp_threads_sleep_between_ops_unless_told_otherwise():
    from core.workarounds.cpu_runtime import blocktime_value

    assert blocktime_value({}) == "0"
    assert blocktime_value({"KMP_BLOCKTIME": "200"}) is None  # the user's own value stays
    assert blocktime_value({"OMP_WAIT_POLICY": "ACTIVE"}) is None
    assert blocktime_value({"PIPELINE_OMP_PASSIVE": "off"}) is None  # the before/after switch of `make bench`
