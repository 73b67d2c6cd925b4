"""Opt-in (`make test-gpu-setup`, ~3 GB and a few minutes): the GPU environment built by the one set-up command, in a
temporary venv on this CPU machine. Paddle must find every CUDA library it opens inside that environment, and the
doctor must say so. Not part of `make test`."""
import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from core import REPO_ROOT


@pytest.fixture(scope="module")
def gpu_venv(tmp_path_factory):
    venv = tmp_path_factory.mktemp("gpu") / "venv"
    t0 = time.time()
    proc = subprocess.run(["make", "-C", str(REPO_ROOT), "setup", "DEVICE=gpu", f"VENV={venv}"], capture_output=True,
                          text=True, timeout=3000)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    size = subprocess.run(["du", "-sm", str(venv)], capture_output=True, text=True).stdout.split()[0]
    print(f"GPU environment: {time.time() - t0:.0f} s to install, {size} MB")
    return venv


def run_in(venv: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}  # (nothing from the caller's setting)
    env["PYTHONPATH"] = str(REPO_ROOT)
    return subprocess.run([str(venv / "bin" / "python"), *args], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


def test_paddle_finds_every_cuda_library_inside_the_environment(gpu_venv):
    code = """
import core, ctypes, json, os
import paddle
from core.workarounds import cuda_libraries
from training.launch.machine import loaded_from
print(json.dumps({"cuda": paddle.version.cuda(), "cudnn": paddle.version.cudnn(),
                  "cudnn_loaded": paddle.device.get_cudnn_version(),
                  "libraries": {name: loaded_from(name) for name in cuda_libraries.LIBRARIES}}))
"""
    proc = run_in(gpu_venv, "-c", code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (found["cuda"], found["cudnn"], found["cudnn_loaded"]) == ("11.8", "8.6.0", 8600)
    for name, path in found["libraries"].items():
        assert path and os.path.realpath(path).startswith(str(gpu_venv)), (name, path)


def test_the_doctor_reports_the_gpu_environment_without_a_gpu(gpu_venv):
    proc = run_in(gpu_venv, "-m", "pipeline", "doctor")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == "ok  paddle     2.6.2, GPU build for CUDA 11.8, cuDNN 8.6.0"
    assert lines[1].startswith("ok  libraries  12/12 CUDA libraries found, all from this environment")
    assert lines[2] == "ok  cudnn      Paddle loads cuDNN 8600" and lines[3] == "ok  nccl       NCCL 2.19.3"
    assert "no NVIDIA driver (nvidia-smi not found): only parallel.device=cpu runs here" in lines[4]
    proc = run_in(gpu_venv, "-m", "pipeline", "doctor", "parallel.device=gpu")
    assert proc.returncode == 1 and "FIX driver     no NVIDIA driver (nvidia-smi not found): install a driver" \
        in proc.stdout


def test_later_plain_targets_keep_the_gpu_environment(gpu_venv):
    """The sequence a user types: `make setup DEVICE=gpu`, then plain `make doctor` and `make train DRY_RUN=1`; the
    environment is still the GPU one afterwards (the stamp remembers the device)."""
    env = {k: v for k, v in os.environ.items() if k not in ("DEVICE", "LD_LIBRARY_PATH")}
    for target in (["doctor"], ["train", "DRY_RUN=1"]):
        proc = subprocess.run(["make", "-C", str(REPO_ROOT), *target, f"VENV={gpu_venv}"], capture_output=True,
                              text=True, timeout=1200, env=env)
        assert "pip install" not in proc.stdout and "paddle-cpu.txt" not in proc.stdout, proc.stdout[-2000:]
    proc = run_in(gpu_venv, "-c", "import core, paddle; print(paddle.version.cuda(), paddle.device.get_cudnn_version())")
    assert proc.returncode == 0 and proc.stdout.split()[-2:] == ["11.8", "8600"], proc.stdout + proc.stderr[-2000:]
