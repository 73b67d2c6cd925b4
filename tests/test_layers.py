"""The import graph is a stack (README "Code"): parsed from the source of every module, lazy imports included.

    top      pipeline/ verbs and orchestration (__main__, train, export, serve, compare, runs, models, bench, ...)
    stages   training/            serving/            (neither imports the other)
    bottom   pipeline/ shared vocabulary: config, layout, errors, tracking, processes, cpu_runtime, tokenizer,
             exportdir, schedules (imports nothing above it)
"""
import ast
from pathlib import Path

import pytest

from pipeline import REPO_ROOT

PACKAGES = ("pipeline", "training", "serving")
BOTTOM = {"pipeline", "pipeline.config", "pipeline.layout", "pipeline.errors", "pipeline.tracking",
          "pipeline.processes", "pipeline.cpu_runtime", "pipeline.tokenizer", "pipeline.exportdir", "pipeline.schedules"}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    return ".".join(parts[:-1]) if parts[-1] == "__init__" else ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in (REPO_ROOT / pkg).glob("*.py")}


def imports_of(path: Path, known: set[str]) -> set[str]:
    """Internal modules `path` imports anywhere (module level or inside functions), except `if TYPE_CHECKING:`."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
               and getattr(node.test, "id", getattr(node.test, "attr", "")) == "TYPE_CHECKING"
               for n in ast.walk(node)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from pipeline import tracking` imports the module pipeline.tracking
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                     for a in node.names]
        else:
            continue
        found.update(n for n in names if n.split(".")[0] in PACKAGES)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports_of(path, set(mods)) - {name} for name, path in mods.items()}


def layer(name: str) -> str:
    if name in BOTTOM:
        return "bottom"
    return {"pipeline": "top", "training": "training", "serving": "serving"}[name.split(".")[0]]


def test_the_parser_sees_lazy_and_from_imports(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("from typing import TYPE_CHECKING\nimport pipeline\nfrom pipeline import tracking\n"
                      "def f():\n    from serving.model import ExportedModel\n"
                      "if TYPE_CHECKING:\n    from training import data\n")
    assert imports_of(source, {"pipeline.tracking"}) == {"pipeline", "pipeline.tracking", "serving.model"}


def test_stages_never_import_each_other():
    wrong = [(m, i) for m, deps in graph().items() for i in deps
             if {layer(m), layer(i)} == {"training", "serving"}]
    assert not wrong, wrong


def test_stages_import_only_the_bottom_of_pipeline():
    wrong = [(m, i) for m, deps in graph().items() for i in deps
             if layer(m) in ("training", "serving") and layer(i) == "top"]
    assert not wrong, wrong


def test_bottom_imports_nothing_above_it():
    wrong = [(m, i) for m, deps in graph().items() if layer(m) == "bottom" for i in deps if layer(i) != "bottom"]
    assert not wrong, wrong


def test_no_import_cycles():
    g = graph()
    state: dict[str, int] = {}

    def visit(node, path):
        state[node] = 1
        for dep in sorted(g.get(node, ())):
            if dep not in g:
                continue
            if state.get(dep) == 1:
                pytest.fail("import cycle: " + " -> ".join(path[path.index(dep):] + [dep]))
            if dep not in state:
                visit(dep, path + [dep])
        state[node] = 2

    for node in sorted(g):
        if node not in state:
            visit(node, [node])


def test_every_make_verb_is_one_module_away():
    """The Makefile calls `python -m pipeline <verb>`; each verb's function lives in one pipeline/ module."""
    from pipeline.__main__ import VERBS, parser

    verbs = set(parser()._subparsers._group_actions[0].choices)
    assert verbs == set(VERBS)
    makefile = (REPO_ROOT / "Makefile").read_text()
    for verb in verbs:
        assert f"-m pipeline {verb}" in makefile, verb
