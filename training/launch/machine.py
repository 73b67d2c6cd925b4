"""What this machine can run (`make doctor` prints these; `make train` checks them before a GPU launch), in a few
lines; each problem is one line that names its fix.

    paddle     the build (CPU, or GPU with the CUDA and cuDNN it was compiled for)
    libraries  (GPU build) each CUDA library Paddle opens: found where, or missing
    cudnn      (GPU build) the cuDNN version Paddle itself loads
    nccl       (GPU build) the NCCL version
    driver     (GPU build) nvidia-smi: driver version and GPUs, or no driver
    layout     the config's processes per node against the visible GPUs (or, on CPU, the cores: gloo)

`make train` runs them before launching a `parallel.device=gpu` config and stops on a problem.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

from core.config import Config
from core.layout import ParallelLayout

# The oldest Linux driver that runs CUDA 11.x applications (minor-version compatibility); 520.61.05 is CUDA 11.8's own.
MIN_DRIVER = (450, 80, 2)


@dataclass
class Check:
    name: str
    ok: bool
    text: str

    def line(self) -> str:
        return f"{'ok ' if self.ok else 'FIX'} {self.name:<10} {self.text}"


def checks(config: Config) -> list[Check]:
    import paddle

    layout = config.layout()
    if not paddle.is_compiled_with_cuda():
        out = [Check("paddle", True, f"{paddle.__version__}, CPU build")]
        if layout.device == "gpu":
            out.append(Check("layout", False, "parallel.device=gpu needs the GPU build: make setup DEVICE=gpu "
                                              "(or parallel.device=cpu)"))
        else:
            from core.workarounds import cpu_runtime

            gloo = ", gloo between them" if layout.world_size > 1 else ""
            out.append(Check("layout", True, f"device cpu: {layout.name}, {layout.world_size} process(es){gloo} on "
                                             f"{cpu_runtime.available_cores()} core(s); serving on CPU"))
        return out
    out = [Check("paddle", True, f"{paddle.__version__}, GPU build for CUDA {paddle.version.cuda()}, cuDNN "
                                 f"{paddle.version.cudnn()}")]
    out += library_checks()
    version = paddle.device.get_cudnn_version()
    out.append(Check("cudnn", bool(version), f"Paddle loads cuDNN {version}" if version else
                     "Paddle cannot load cuDNN: make setup DEVICE=gpu installs it (requirements/cuda-runtime.txt)"))
    out.append(nccl_check())
    driver, gpus = nvidia_smi()
    if not driver.ok and layout.device != "gpu":  # (the GPU build runs CPU configs without a GPU)
        driver = Check("driver", True, f"{driver.text.split(':')[0]}: only parallel.device=cpu runs here")
    out.append(driver)
    out.append(layout_check(layout, gpus))
    return out


def loaded_from(name: str) -> str | None:
    """Where the dynamic loader finds `name` in this process (None: not found), as Paddle's dlopen would."""
    try:
        ctypes.CDLL(name)
    except OSError:
        return None
    base = name.split(".so")[0] + ".so"
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "/" in line and os.path.basename(line.split()[-1])
                 .startswith(base)}
    return sorted(paths)[0] if paths else "(loaded)"


def library_checks() -> list[Check]:
    from core.workarounds import cuda_libraries

    found, missing = [], []
    for name in cuda_libraries.LIBRARIES:
        where = loaded_from(name)
        (found if where else missing).append((name, where))
    venv = os.path.realpath(sys.prefix)
    outside = [n for n, w in found if not os.path.realpath(w).startswith(venv)]
    text = f"{len(found)}/{len(cuda_libraries.LIBRARIES)} CUDA libraries found"
    text += f", all from this environment ({cuda_libraries.nvidia_root()})" if not outside else \
        f"; from the system: {', '.join(outside)}"
    out = [Check("libraries", not missing, text if not missing else
                 f"missing {', '.join(n for n, _ in missing)}: make setup DEVICE=gpu installs them "
                 f"(requirements/cuda-runtime.txt); LD_LIBRARY_PATH={os.environ.get('LD_LIBRARY_PATH', '')}")]
    return out


def nccl_check() -> Check:
    try:
        lib = ctypes.CDLL("libnccl.so")
        version = ctypes.c_int()
        lib.ncclGetVersion(ctypes.byref(version))
    except (OSError, AttributeError):
        return Check("nccl", False, "libnccl.so not found: make setup DEVICE=gpu installs nvidia-nccl-cu11")
    v = version.value
    return Check("nccl", True, f"NCCL {v // 10000}.{v % 10000 // 100}.{v % 100}")


def nvidia_smi() -> tuple[Check, int]:
    """The driver check and the number of GPUs this process may use."""
    if not shutil.which("nvidia-smi"):
        return Check("driver", False, "no NVIDIA driver (nvidia-smi not found): install a driver that supports CUDA "
                                      "11.8 (>= 450.80.02 on Linux; any CUDA 12 driver does)"), 0
    proc = subprocess.run(["nvidia-smi", "--query-gpu=index,name,driver_version,memory.total",
                           "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
    rows = [r.split(", ") for r in proc.stdout.strip().splitlines() if r.strip()]
    if proc.returncode != 0 or not rows:
        return Check("driver", False, f"nvidia-smi failed ({proc.stderr.strip()[:120] or 'no GPU listed'}): check "
                                      f"the driver installation"), 0
    driver = rows[0][2]
    ok = tuple(int(x) for x in driver.split(".")[:3]) >= MIN_DRIVER
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = len(rows) if visible is None else len([d for d in visible.split(",") if d.strip()])
    names = ", ".join(sorted({r[1] for r in rows}))
    text = f"driver {driver}, {len(rows)} GPU(s): {names}" + (f"; CUDA_VISIBLE_DEVICES={visible}" if visible else "")
    if not ok:
        text = f"driver {driver} is older than 450.80.02: CUDA 11.8 needs a newer driver"
    return Check("driver", ok, text), gpus


def layout_check(layout: ParallelLayout, gpus: int) -> Check:
    if layout.device != "gpu":
        return Check("layout", True, f"{layout.name} on CPU (parallel.device=cpu)"
                                     + (", gloo between processes" if layout.world_size > 1 else ""))
    per_node = layout.world_size // layout.nnodes
    if per_node > gpus:
        return Check("layout", False, f"{layout.name} needs {per_node} GPU(s) per node, {gpus} visible: change "
                                      f"parallel.* or CUDA_VISIBLE_DEVICES")
    return Check("layout", True, f"{layout.name}: {per_node} process(es) per node on {gpus} visible GPU(s), NCCL")
