"""The Makefile's environment rule, read by real `make -n` (what it would run) on a stand-in environment: after
`make setup DEVICE=gpu` every plain target keeps the GPU environment as it is, and a switch of device is explicit."""
import os
import subprocess
import time

from core import REPO_ROOT


def planned(venv, *args: str) -> str:
    """The commands `make -n <args>` would run against the environment `venv`."""
    env = {k: v for k, v in os.environ.items() if k != "DEVICE"}
    proc = subprocess.run(["make", "-n", "-C", str(REPO_ROOT), *args, f"VENV={venv}"], capture_output=True, text=True,
                          env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def installed(tmp_path, device: str):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").touch(mode=0o755)
    stamp = venv / f".installed-{device}"
    stamp.touch()
    later = time.time() + 60  # (newer than every requirements file)
    os.utime(stamp, (later, later))
    return venv


def test_the_gpu_environment_is_kept_by_every_later_plain_target(tmp_path):
    venv = installed(tmp_path, "gpu")
    for target in (["doctor"], ["train", "DRY_RUN=1"], ["test-fast"], ["setup"]):
        commands = planned(venv, *target)
        assert "pip install" not in commands and "paddle-cpu.txt" not in commands, (target, commands)
    assert f"{venv}/bin/python -m pipeline doctor" in planned(venv, "doctor")


def test_switching_device_is_explicit_and_says_what_it_replaces(tmp_path):
    venv = installed(tmp_path, "gpu")
    commands = planned(venv, "setup", "DEVICE=cpu")
    assert f"switching {venv} from DEVICE=gpu to DEVICE=cpu" in commands
    assert "pip uninstall" in commands and "-r requirements/paddle-cpu.txt" in commands
    fresh = tmp_path / "fresh"  # (no environment yet: the CPU build, as before)
    assert "-r requirements/paddle-cpu.txt" in planned(fresh, "doctor") and "from DEVICE=" not in planned(fresh, "doctor")
