"""The CUDA libraries of a GPU environment built from pip alone.            paddlepaddle-gpu 2.6.2 (CUDA 11.8)

Bug: the paddlepaddle-gpu 2.6.2 wheel is built against CUDA 11.8 / cuDNN 8.6 but declares no NVIDIA packages, and it
dlopens unversioned names (`libcudnn.so`, `libnccl.so`, ...; cuDNN in turn dlopens `libnvrtc.so`) from
LD_LIBRARY_PATH or /usr/local/cuda. NVIDIA's pip packages (`nvidia-*-cu11`, requirements/cuda-runtime.txt) ship
versioned files only (`libcudnn.so.8`, `libnvrtc.so.11.2`), in their own folders. `FLAGS_cudnn_dir` in the environment
did not change where Paddle looked (platform notes, 2026-12-03).

Fix: a folder of unversioned links (`<venv>/cuda-libs/`) to the packages' files, then the packages' own lib folders,
first on LD_LIBRARY_PATH. The dynamic loader reads LD_LIBRARY_PATH when a process starts, so `apply()` (run by
`import core` in every process of the pipeline) re-executes a process once with it set; the processes it starts
(ranks, serving workers, data workers) inherit it. Nothing happens where no NVIDIA package is installed (a CPU
environment). `PIPELINE_CUDA_REEXEC=off` turns the re-execution off (the doctor then reports the libraries missing).
"""
from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path

# Unversioned name Paddle (or cuDNN) opens -> (nvidia package folder, the file the package ships)
LIBRARIES = {
    "libcudart.so": ("cuda_runtime", "libcudart.so.11.0"),
    "libcublas.so": ("cublas", "libcublas.so.11"),
    "libcublasLt.so": ("cublas", "libcublasLt.so.11"),
    "libcudnn.so": ("cudnn", "libcudnn.so.8"),
    "libcufft.so": ("cufft", "libcufft.so.10"),
    "libcurand.so": ("curand", "libcurand.so.10"),
    "libcusolver.so": ("cusolver", "libcusolver.so.11"),
    "libcusparse.so": ("cusparse", "libcusparse.so.11"),
    "libnccl.so": ("nccl", "libnccl.so.2"),
    "libnvrtc.so": ("cuda_nvrtc", "libnvrtc.so.11.2"),
    "libcupti.so": ("cuda_cupti", "libcupti.so.11.8"),
    "libnvToolsExt.so": ("nvtx", "libnvToolsExt.so.1"),
}
LINKS_DIR = "cuda-libs"


def nvidia_root() -> Path:
    return Path(sysconfig.get_paths()["purelib"]) / "nvidia"


def installed() -> bool:
    return (nvidia_root() / "cudnn").is_dir()


def lib_dirs() -> list[Path]:
    root = nvidia_root()
    return sorted({root / package / "lib" for package, _ in LIBRARIES.values() if (root / package / "lib").is_dir()})


def links_dir() -> Path:
    return Path(sys.prefix) / LINKS_DIR


def make_links() -> Path:
    """The folder of unversioned links (made once; links to files that exist only)."""
    folder = links_dir()
    folder.mkdir(exist_ok=True)
    for name, (package, target) in LIBRARIES.items():
        source = nvidia_root() / package / "lib" / target
        link = folder / name
        if source.is_file() and not link.exists():
            tmp = folder / f".{name}.{os.getpid()}"
            tmp.unlink(missing_ok=True)
            tmp.symlink_to(source)
            os.replace(tmp, link)
    return folder


def library_path() -> str:
    """LD_LIBRARY_PATH with the links and the packages' folders first (the rest kept after them)."""
    ours = [str(links_dir())] + [str(d) for d in lib_dirs()]
    rest = [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p and p not in ours]
    return os.pathsep.join(ours + rest)


def configured() -> bool:
    current = os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep)
    return current[: 1 + len(lib_dirs())] == library_path().split(os.pathsep)[: 1 + len(lib_dirs())]


def apply() -> None:
    """Re-execute this process with the CUDA libraries on LD_LIBRARY_PATH, if they are installed and not there yet."""
    if not installed() or configured() or os.environ.get("PIPELINE_CUDA_REEXEC", "on") == "off":
        return
    make_links()
    os.environ["LD_LIBRARY_PATH"] = library_path()
    argv = getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv]
    if not argv[1:] or argv[1] == "-":  # (an interactive or stdin session cannot be run again: say what to set)
        print(f"cuda_libraries: set LD_LIBRARY_PATH={os.environ['LD_LIBRARY_PATH']} before starting Python "
              f"(core/workarounds/cuda_libraries.py)", file=sys.stderr)
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *argv[1:]], os.environ)
