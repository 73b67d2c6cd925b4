"""core/workarounds/__init__.py OVERRIDES is complete: every place that replaces or overrides Paddle / PaddleNLP /
Paddle Serving code is a row of it, and every row matches the code. Found in the source:

    assignments into their modules, classes and objects   llama.LlamaRMSNorm.forward = ..., setattr(core.X, ...)
    private attributes set on an object we did not make   engine._forward_step = ...
    private methods of theirs overridden in a subclass    class T(Trainer): def _save_checkpoint(...)
"""
import ast
import importlib
from pathlib import Path

import pytest

import serving  # noqa: F401  (Paddle Serving logs where serving says, when a base class is imported)
from core import REPO_ROOT
from core.workarounds import OVERRIDES

THIRD_PARTY = ("paddle", "paddlenlp", "paddle_serving_server", "paddle_serving_app", "paddle_serving_client")
PACKAGES = ("core", "model", "training", "serving", "export", "pipeline", "bench")


def _chain(node) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else None


def _resolve(dotted: str):
    """The object a dotted path names (the longest importable module, then attributes); None if it does not exist."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr, None)
        return obj
    return None


def overrides_in(source: str) -> set[str]:
    tree = ast.parse(source)
    aliases, own = {}, {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases.update({a.asname or a.name.split(".")[0]: (a.name if a.asname else a.name.split(".")[0])
                            for a in node.names if a.name.split(".")[0] in THIRD_PARTY})
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in THIRD_PARTY:
            aliases.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
    found = set()
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = [e for t in node.targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
        elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setattr" and len(node.args) >= 2:
            chain = _chain(node.args[0])
            if chain and chain[0] in aliases:
                found.add(".".join(chain[1:] + ["*"]))
        for target in targets:
            chain = _chain(target) if isinstance(target, ast.Attribute) else None
            if not chain or chain[0] in ("self", "cls") or chain[0] in own:
                continue
            if chain[0] in aliases or (chain[-1].startswith("_") and not chain[-1].startswith("__")):
                found.add(".".join(chain[1:]))
        if isinstance(node, ast.ClassDef):
            for base in filter(None, map(_chain, node.bases)):
                if base[0] not in aliases:
                    continue
                cls = _resolve(".".join([aliases[base[0]], *base[1:]]))
                found.update(f"{base[-1]}.{item.name}" for item in node.body if isinstance(item, ast.FunctionDef)
                             and item.name.startswith("_") and not item.name.startswith("__")
                             and hasattr(cls, item.name))
    return found


def _listed(module: str) -> set[str]:
    return {t for row in OVERRIDES if row.module == module for t in row.targets}


def _matches(found: str, listed: set[str]) -> bool:
    # `setattr(core.ProcessGroupGloo, f"...", ...)` is found as ProcessGroupGloo.*: any listed member of it counts
    return found in listed or (found.endswith(".*") and any(t.startswith(found[:-1]) for t in listed))


def test_the_finder_sees_each_kind_of_override():
    source = ("import paddlenlp.transformers.llama.modeling as llama\nfrom paddlenlp.trainer import Trainer\n"
              "from paddle.base import core\n"
              "def f(engine):\n    llama.LlamaRMSNorm.forward = g\n    engine._forward_step = g\n"
              "    setattr(core.ProcessGroupGloo, 'x', g)\n    ours._cache = 1\n"
              "def ours(): pass\nclass T(Trainer):\n    def _save_checkpoint(self): pass\n"
              "    def _not_theirs(self): pass\n    def train(self): pass\n")
    assert overrides_in(source) == {"LlamaRMSNorm.forward", "_forward_step", "ProcessGroupGloo.*",
                                    "Trainer._save_checkpoint"}


def test_every_override_is_in_the_table():
    missing = []
    for package in PACKAGES:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            module = str(path.relative_to(REPO_ROOT))
            listed = _listed(module)
            missing += [f"{module}: {f}" for f in sorted(overrides_in(path.read_text())) if not _matches(f, listed)]
    assert not missing, "add to core/workarounds/__init__.py OVERRIDES: " + "; ".join(missing)


@pytest.mark.parametrize("row", OVERRIDES, ids=lambda r: f"{r.module}:{','.join(r.targets) or '-'}")
def test_every_row_matches_the_code(row):
    path = REPO_ROOT / row.module
    assert path.is_file(), f"{row.module} does not exist"
    found = overrides_in(path.read_text())
    stale = [t for t in row.targets if not any(_matches(f, {t}) for f in found)]
    assert not stale, f"{row.module} no longer overrides {stale}"
    assert row.bug and row.versions


def test_every_workaround_module_has_a_row():
    modules = {str(p.relative_to(REPO_ROOT)) for p in (REPO_ROOT / "core" / "workarounds").glob("*.py")}
    assert modules == {row.module for row in OVERRIDES if row.module.startswith("core/workarounds/")}
