"""The Makefile's environment rule, read by real `make -n` (what it would run) on a stand-in environment: after
`make setup DEVICE=gpu` every plain target keeps the GPU environment as it is, and a switch of device is explicit.
And the Makefile checked against the verbs: it passes only options they take, and every option has a way in."""
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


def make_recipes(text: str) -> dict[str, str]:
    """verb -> the Makefile recipe line that runs `python -m pipeline <verb> ...`."""
    import re

    return {m.group(1): m.group(0) for m in re.finditer(r"\$\(PY\) -m pipeline ([\w-]+)\b.*", text)}


def verb_options(verb: str) -> set[str]:
    import argparse

    from pipeline.__main__ import parser

    sub = next(a for a in parser(verb)._actions if isinstance(a, argparse._SubParsersAction)).choices[verb]
    return {s for a in sub._actions for s in a.option_strings} - {"-h", "--help"}


def makefile_mismatches(recipes: dict[str, str], options) -> list[str]:
    """A recipe passing an option its verb does not take, or a verb option the Makefile gives no way in (neither a
    variable of its own nor ARGS, which reaches the verb's parser word by word: pipeline/runner/cli.py words)."""
    import re

    wrong = []
    for verb, line in sorted(recipes.items()):
        passed, takes = set(re.findall(r"(--[a-z][\w-]*)", line)) - {"--args"}, options(verb)
        wrong += [f"{verb}: the Makefile passes {o}, which it does not take" for o in sorted(passed - takes)]
        if '--args "$$ARGS"' not in line:
            wrong += [f"{verb}: {o} has no way in from make" for o in sorted(takes - passed)]
    return wrong


def test_the_makefile_passes_only_what_the_verbs_take_and_every_option_has_a_way_in():
    recipes = make_recipes((REPO_ROOT / "Makefile").read_text())
    assert len(recipes) >= 25
    assert makefile_mismatches(recipes, verb_options) == []


def test_the_makefile_check_sees_a_renamed_option_and_one_without_a_way_in():
    recipes = {"compare": '$(PY) -m pipeline compare --config $(CONFIG) $(if $(METRIC),--metrics $(METRIC))',
               "train": '$(PY) -m pipeline train --config $(CONFIG) --args "$$ARGS"'}
    assert makefile_mismatches(recipes, verb_options) == [
        "compare: the Makefile passes --metrics, which it does not take", "compare: --experiment has no way in from make",
        "compare: --filter has no way in from make", "compare: --metric has no way in from make",
        "compare: --out has no way in from make"]
