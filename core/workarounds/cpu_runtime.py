"""CPU math runtime: MKL's CPU-vendor check and the intra-op thread count. Platform workaround module.

Three facts about Paddle 2.6.2's CPU build (measured on these machines, see docs/platform-notes.md):

1. It bundles MKL 2019.0.5 (`paddle/libs/libmklml_intel.so`). On AMD CPUs MKL's dispatcher chooses its generic
   kernels, several times slower at fp32 matmul than its AVX2 kernels, which `MKL_DEBUG_CPU_TYPE=5` selects: an
   undocumented switch MKL reads at its first dispatch and honours up to 2020.0 (removed in 2020.1). On Intel CPUs
   the switch is harmful (AVX-512 machines lose their AVX-512 kernels), so it is set only on AMD (the measured
   figures: docs/platform-notes.md). It must be in
   the environment before MKL's first call: `prepare_process()` runs from `core/__init__.py`, the module every
   entry point imports before paddle (the same place as the zlib rule), and child processes inherit it.
   `PIPELINE_MKL_AMD_FIX=off` leaves the environment alone (for before/after benchmarks); a value of
   `MKL_DEBUG_CPU_TYPE` the user set is never overridden.
2. Paddle sets `OMP_NUM_THREADS=1` at import when it is unset, so each process computes on one core whatever the
   machine has (setting the variable instead makes Paddle print a warning at every import).
   `apply_threads(n)` calls `paddle.base.core.set_num_threads(n)` after import; `threads_per_process` derives n from
   the cores this process may use and the processes that share them (`parallel.cpu_threads` overrides).
3. Paddle's MKL runs on Intel OpenMP (`libiomp5.so`), whose worker threads spin for KMP_BLOCKTIME (200 ms by default) after
   every parallel region -- while Python dispatches the next small eager op, so the spinning threads take the
   cores the op needs (system time a large share of a run's CPU time; docs/platform-notes.md). `prepare_process()` sets
   `KMP_BLOCKTIME=0` (threads sleep at once) unless KMP_BLOCKTIME or OMP_WAIT_POLICY is set;
   `PIPELINE_OMP_PASSIVE=off` leaves it alone (for before/after benchmarks).

`PIPELINE_CPU_LLAMA_OPS=off` turns off the model's CPU ops (model/llama.py); read here because runs report it.
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
from pathlib import Path


MKL_SWITCH = "MKL_DEBUG_CPU_TYPE"
FIX_ENV = "PIPELINE_MKL_AMD_FIX"
_VERSION_ENV = "PIPELINE_MKL_VERSION"  # cache for child processes: reading it loads the 130 MB library
BLOCKTIME = "KMP_BLOCKTIME"
PASSIVE_ENV = "PIPELINE_OMP_PASSIVE"
CPU_LLAMA_OPS_ENV = "PIPELINE_CPU_LLAMA_OPS"


def cpu_llama_ops_enabled(environ=os.environ) -> bool:
    return environ.get(CPU_LLAMA_OPS_ENV, "auto") != "off"


def cpu_vendor() -> str:
    """`AuthenticAMD`, `GenuineIntel`, ... from /proc/cpuinfo; "" where that is not available."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def mkl_version() -> str:
    """MKL's version string of the bundled library (e.g. "2019.0.5"), "" when Paddle ships none (GPU/OpenBLAS builds).

    Loads the library with ctypes without importing paddle; asking for the version does not make MKL read its
    dispatch switches (checked: setting MKL_DEBUG_CPU_TYPE after this call still takes effect)."""
    if _VERSION_ENV in os.environ:
        return os.environ[_VERSION_ENV]
    version = ""
    spec = importlib.util.find_spec("paddle")
    libs = Path(spec.origin).parent / "libs" if spec and spec.origin else None
    if libs and (libs / "libmklml_intel.so").exists():
        try:
            if (libs / "libiomp5.so").exists():
                ctypes.CDLL(str(libs / "libiomp5.so"), mode=ctypes.RTLD_GLOBAL)
            buf = ctypes.create_string_buffer(256)
            ctypes.CDLL(str(libs / "libmklml_intel.so")).MKL_Get_Version_String(buf, len(buf))
            # "Intel(R) Math Kernel Library Version 2019.0.5 Product Build 20190808 for Intel(R) 64 ..."
            words = buf.value.decode(errors="replace").split()
            version = words[words.index("Version") + 1] if "Version" in words else ""
        except (OSError, AttributeError, ValueError):
            version = ""
    os.environ[_VERSION_ENV] = version
    return version


def honours_vendor_switch(version: str) -> bool:
    """MKL_DEBUG_CPU_TYPE works in MKL releases before 2020.1."""
    try:
        parts = tuple(int(p) for p in version.split(".")[:2])
    except ValueError:
        return False
    return bool(parts) and parts < (2020, 1)


def mkl_switch_value(vendor: str, version: str, environ: dict) -> str | None:
    """The MKL_DEBUG_CPU_TYPE value to set, or None to leave the environment as it is."""
    if environ.get(FIX_ENV, "auto") == "off" or MKL_SWITCH in environ:
        return None
    if vendor == "AuthenticAMD" and honours_vendor_switch(version):
        return "5"
    return None


def blocktime_value(environ: dict) -> str | None:
    """The KMP_BLOCKTIME to set (fact 3), or None to leave the environment as it is."""
    if environ.get(PASSIVE_ENV, "auto") == "off" or BLOCKTIME in environ or "OMP_WAIT_POLICY" in environ:
        return None
    return "0"


def prepare_process() -> None:
    """Before paddle loads: OpenMP threads that sleep between ops, and MKL's fast kernels on AMD. Cheap on other
    CPUs (one read of /proc/cpuinfo)."""
    value = blocktime_value(os.environ)
    if value is not None:
        os.environ[BLOCKTIME] = value
    vendor = cpu_vendor()
    if vendor != "AuthenticAMD":  # decided without loading MKL
        return
    value = mkl_switch_value(vendor, mkl_version(), os.environ)
    if value is not None:
        os.environ[MKL_SWITCH] = value


def available_cores() -> int:
    """Cores this process may run on (its affinity mask: what Slurm, taskset or a container give it)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def threads_per_process(configured: int, processes: int, cores: int | None = None) -> int:
    """Math threads for each of `processes` processes sharing this node: `configured` if set, else an even share of
    the cores (at least 1)."""
    if configured > 0:
        return configured
    cores = available_cores() if cores is None else cores
    return max(1, cores // max(1, processes))


def apply_threads(threads: int) -> None:
    """After `import paddle`: the intra-op thread count of this process (Paddle itself pins it to 1)."""
    import paddle

    paddle.base.core.set_num_threads(int(threads))


def describe(threads: int) -> dict[str, str]:
    """What this process runs with, for MLflow tags and logs."""
    return {"cpu_vendor": cpu_vendor() or "unknown", "mkl_version": mkl_version() or "none",
            "mkl_debug_cpu_type": os.environ.get(MKL_SWITCH, "unset"), "threads": str(threads),
            "kmp_blocktime": os.environ.get(BLOCKTIME, "unset"), "cores": str(available_cores()),
            "cpu_llama_ops": "on" if cpu_llama_ops_enabled() else "off"}
