"""Every `make ...` command written in README and docs/ goes through real make (the Makefile's recipes, on a stand-in
environment whose python only records its command line) and then through the CLI's own parsing
(`pipeline.__main__.parse`, `bench.__main__.parse`): a documented command that make, the shell or the CLI would
refuse fails here, and nothing runs. Placeholders (`<run id>`, `…`) are given stand-in values first."""
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from core import REPO_ROOT
from core.config import DEFAULT_CONFIG, load_config

# targets that are not the pipeline's CLI: make alone is asked whether it knows them (`make -n`)
NOT_RUN = {"setup", "clean", "test-gpu-setup"}
RECORDER = '#!/bin/sh\nprintf "%s\\0" "$@" > "$RECORD/$(date +%s%N)-$$"\n'
PLACEHOLDER = "<placeholder>"  # (what `<run dir or run id>` and the like become before the words are split)
DIAGRAM = re.compile(r"[─│▶◀└┘┌┐]")


def documents() -> list[Path]:
    return [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]


def code_lines(text: str):
    """The lines of the fenced code blocks (continuations joined), diagrams left out."""
    inside, pending = False, ""
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            inside, pending = not inside, ""
            continue
        if inside and not DIAGRAM.search(line):
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            yield pending + line
            pending = ""


def commands_in(line: str) -> list[str]:
    """The make commands of a shell line: `make a && make b; make c  # comment`."""
    try:
        words = shlex.split(line, comments=True)
    except ValueError:
        return []
    found, current = [], None
    for word in words + [";"]:
        if word in ("&&", ";", "||", "|"):
            if current:
                found.append(shlex.join(current))
            current = None
        elif current is not None:
            current.append(word)
        elif word == "make":
            current = [word]
    return found


def synopsis_forms(span: str) -> list[str]:
    """An inline `make verb X=<v> [Y=…] [ARGS="..."]`: the form without its optional parts, then with each one
    (`a\\|b` alternatives: the first)."""
    span = re.sub(r"\\?\|[^\s\]]*", "", span)
    optional = re.findall(r'\s\[([A-Z_]+=(?:"[^"]*"|[^\]])*)\]', span)
    base = re.sub(r'\s\[[A-Z_]+=(?:"[^"]*"|[^\]])*\]', "", span)
    return [base] + [f"{base} {part}" for part in optional]


def documented() -> list[tuple[str, str]]:
    found = []
    for doc in documents():
        text = doc.read_text(encoding="utf-8")
        for line in code_lines(text):
            found += [(doc.name, c) for c in commands_in(line)]
        for span in re.findall(r"`(make [^`]+)`", text):
            if span.strip() != "make <verb>":
                found += [(doc.name, form) for form in synopsis_forms(span)]
    return sorted(set(found))


def stand_in(word: str, run_dir: Path) -> str:
    """A make variable's placeholder value -> something of its kind."""
    name, _, value = word.partition("=")
    value = value.replace("\\|", "|").split("|")[0]
    placeholder = not value or "<" in value or "…" in value or value in ("...", "F", "N")
    if name == "ARGS":  # (inside ARGS: "..." and "…" stand for more overrides; <dir> for a path)
        value = " ".join(w for w in value.split() if w not in ("...", "…"))
        return f"ARGS={value.replace(PLACEHOLDER, str(run_dir))}"
    if name == "RESUME":
        return f"RESUME={run_dir}"
    if not placeholder:
        return word
    return {"CONFIG": f"CONFIG={DEFAULT_CONFIG}", "PARALLEL": "PARALLEL=2", "RPM": "RPM=60",
            "TPM": "TPM=1000"}.get(name, f"{name}=x")


@pytest.fixture(scope="module")
def stand_in_env(tmp_path_factory):
    """A venv whose python records its arguments, newer than every requirements file (no set-up runs), and a run
    directory for RESUME=."""
    root = tmp_path_factory.mktemp("documented")
    venv = root / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(RECORDER)
    (venv / "bin" / "python").chmod(0o755)
    stamp = venv / ".installed-cpu"
    stamp.touch()
    later = max(p.stat().st_mtime for p in (REPO_ROOT / "requirements").iterdir()) + 1
    os.utime(stamp, (later, later))
    run_dir = root / "runs" / "some-run"  # (a tp2 x pp2 run: docs/operations.md resumes one on one process)
    run_dir.mkdir(parents=True)
    recorded = load_config(REPO_ROOT / "configs" / "tiny-tp2pp2.yaml").to_dict()
    (run_dir / "config.yaml").write_text(yaml.safe_dump(recorded, allow_unicode=True))
    return venv, run_dir, root


def recorded_by_make(command: str, venv: Path, run_dir: Path, record: Path) -> list[list[str]]:
    words = shlex.split(re.sub(r"<[^>]*>", PLACEHOLDER, command))[1:]
    target = next(w for w in words if "=" not in w and not w.startswith("-"))
    variables = [stand_in(w, run_dir) if "=" in w and not w.startswith("-") else w for w in words]
    env = {k: v for k, v in os.environ.items() if k not in ("DEVICE", "ARGS", "MAKEFLAGS", "MFLAGS")}
    record.mkdir()
    flags = ["-n"] if target in NOT_RUN else []
    proc = subprocess.run(["make", "-s", "-C", str(REPO_ROOT), *flags, *variables, f"VENV={venv}", "DEVICE=cpu"],
                          capture_output=True, text=True, env={**env, "RECORD": str(record)}, timeout=120)
    assert proc.returncode == 0, f"{command!r}: make says {proc.stderr.strip()[-500:]}"
    return [p.read_bytes().decode().split("\0")[:-1] for p in sorted(record.iterdir())]


def parses(argv: list[str]) -> None:
    """One recorded `python -m <module> ...` through its module's own parsing."""
    module, rest = argv[1], argv[2:]
    if module == "pipeline":
        from pipeline.__main__ import parse

        parse(rest)
    elif module == "bench":
        from bench.__main__ import parse

        parse(rest)


def test_every_documented_make_command_parses(stand_in_env):
    from core.errors import ConfigError

    venv, run_dir, root = stand_in_env
    commands = documented()
    assert len(commands) > 60 and any("gateway.split={champion: 90, challenger: 10}" in c for _, c in commands)
    from concurrent.futures import ThreadPoolExecutor

    def through_make(item):  # (make runs in threads, four at a time; the parsing below stays in this thread)
        i, (doc, command) = item
        try:
            return recorded_by_make(command, venv, run_dir, root / f"record-{i}")
        except AssertionError as exc:
            return exc

    failed = []
    with ThreadPoolExecutor(4) as pool:
        recorded = list(pool.map(through_make, enumerate(commands)))
    for (doc, command), argvs in zip(commands, recorded):
        try:
            if isinstance(argvs, AssertionError):
                raise argvs
            for argv in argvs:
                parses(argv)
        except (AssertionError, ConfigError, SystemExit) as exc:
            failed.append(f"{doc}: {command}: {exc!r}"[:400])
    assert not failed, "\n".join(failed)


def test_a_command_that_cannot_parse_is_caught(stand_in_env):
    """(the checker itself: make's own refusal, a value the CLI refuses, a verb's unknown flag)"""
    from core.errors import ConfigError

    venv, run_dir, root = stand_in_env
    with pytest.raises(AssertionError, match="make says"):
        recorded_by_make("make serve --foreground", venv, run_dir, root / "bad-make")
    for i, bad in enumerate(['make train ARGS="training.max_steps={a: 1"', 'make generate ARGS="--no-such-flag"']):
        with pytest.raises((ConfigError, SystemExit)):
            for argv in recorded_by_make(bad, venv, run_dir, root / f"bad-{i}"):
                parses(argv)


def test_make_hands_a_value_with_spaces_to_the_verb_whole(stand_in_env):
    venv, run_dir, root = stand_in_env
    command = ('make gateway ARGS="gateway.backends={champion: [http://127.0.0.1:18182], challenger: '
               '[http://127.0.0.1:28182/v1]} gateway.split={champion: 90, challenger: 10}"')
    (argv,) = recorded_by_make(command, venv, run_dir, root / "split")
    from pipeline.__main__ import parse

    args, config = parse(argv[2:])
    assert config.gateway.split == {"champion": 90, "challenger": 10}
    assert config.gateway.backends == {"champion": ["http://127.0.0.1:18182"],
                                       "challenger": ["http://127.0.0.1:28182/v1"]}


def test_the_cli_joins_a_split_value_back_and_leaves_flags_alone():
    from pipeline.runner.cli import words

    assert words(["gateway", "gateway.split={a:", "90,", "b:", "10}", "gateway.port=1"]) == [
        "gateway", "gateway.split={a: 90, b: 10}", "gateway.port=1"]
    assert words(["generate", "--args", "--workers 1 data.text='a b' c x.y=[1, 2]"]) == [
        "generate", "--workers", "1", "data.text=a b c", "x.y=[1, 2]"]
    # (never globbed or brace-expanded, as the shell would: {a:1,b:2} stays one mapping)
    assert words(["--args", "gateway.split={a:90,b:10} name=*"]) == ["gateway.split={a:90,b:10}", "name=*"]
