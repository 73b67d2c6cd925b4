"""core/workarounds/__init__.py OVERRIDES is complete: every place that replaces or overrides Paddle / PaddleNLP /
Paddle Serving code is a row of it, and every row matches the code. Found in the source:

    assignments into their modules, classes and objects   llama.LlamaRMSNorm.forward = ..., setattr(core.X, ...)
    private attributes set on an object we did not make   engine._forward_step = ...
    private methods of theirs overridden in a subclass    class T(Trainer): def _save_checkpoint(...)
    ... however the class is joined to theirs            class T(OurMixin, Trainer), type("T", (OurMixin, Trainer), {})
"""
import ast
import importlib

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


def _own_methods(name: str, own_classes: dict, aliases: dict) -> set[str]:
    """Methods a class of ours defines: one of this module (its AST), or one imported from our packages."""
    if name in own_classes:
        return {item.name for item in own_classes[name].body if isinstance(item, (ast.FunctionDef,
                                                                                  ast.AsyncFunctionDef))}
    cls = _resolve(aliases.get(name, "")) if aliases.get(name, "").split(".")[0] in PACKAGES else None
    return {k for k, v in vars(cls).items() if callable(v)} if isinstance(cls, type) else set()


def _joined(bases: list[list[str]], body_methods: set[str], own_classes: dict, aliases: dict) -> set[str]:
    """A class joined from `bases` (their classes and ours, mixins included) with `body_methods` of its own: each
    private method of theirs that one of ours defines, as `TheirClass.method`."""
    ours = set(body_methods)
    for base in bases:
        if base[0] not in aliases or aliases[base[0]].split(".")[0] not in THIRD_PARTY:
            ours |= _own_methods(base[0], own_classes, aliases) if len(base) == 1 else set()
    found = set()
    for base in bases:
        if base[0] in aliases and aliases[base[0]].split(".")[0] in THIRD_PARTY:
            cls = _resolve(".".join([aliases[base[0]], *base[1:]]))
            found.update(f"{base[-1]}.{m}" for m in ours
                         if m.startswith("_") and not m.startswith("__") and hasattr(cls, m))
    return found


def overrides_in(source: str) -> set[str]:
    tree = ast.parse(source)
    aliases, own = {}, {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    own_classes = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases.update({a.asname or a.name.split(".")[0]: (a.name if a.asname else a.name.split(".")[0])
                            for a in node.names if a.name.split(".")[0] in THIRD_PARTY})
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in THIRD_PARTY + PACKAGES:
            aliases.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
    third = {k for k, v in aliases.items() if v.split(".")[0] in THIRD_PARTY}
    found = set()
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = [e for t in node.targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
        elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setattr" and len(node.args) >= 2:
            chain = _chain(node.args[0])
            if chain and chain[0] in third:
                found.add(".".join(chain[1:] + ["*"]))
        elif (isinstance(node, ast.Call) and getattr(node.func, "id", "") == "type" and len(node.args) == 3
              and isinstance(node.args[1], ast.Tuple)):  # type("T", (OurMixin, Theirs), {...})
            namespace = node.args[2]
            keys = {k.value for k in getattr(namespace, "keys", []) if isinstance(k, ast.Constant)}
            found |= _joined([c for c in map(_chain, node.args[1].elts) if c], keys, own_classes, aliases)
        for target in targets:
            chain = _chain(target) if isinstance(target, ast.Attribute) else None
            if not chain or chain[0] in ("self", "cls") or chain[0] in own:
                continue
            if chain[0] in third or (chain[-1].startswith("_") and not chain[-1].startswith("__")):
                found.add(".".join(chain[1:]))
        if isinstance(node, ast.ClassDef):
            methods = {i.name for i in node.body if isinstance(i, (ast.FunctionDef, ast.AsyncFunctionDef))}
            found |= _joined([c for c in map(_chain, node.bases) if c], methods, own_classes, aliases)
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


def test_the_finder_sees_a_mixin_however_it_is_joined():
    """A mixin's private method that overrides theirs counts, whether the class is made by `class` or `type(...)`,
    and whether the mixin is in the same module or imported from ours."""
    mixin = ("class Mixin:\n    def _wrap_model(self, model): pass\n    def _ours_only(self): pass\n"
             "    def compute_loss(self, *a): pass\n")
    by_type = "from paddlenlp.trainer import Trainer\n" + mixin + \
        "def make():\n    return type('T', (Mixin, Trainer), {'_save': None, 'mesh': 1})\n"
    assert overrides_in(by_type) == {"Trainer._wrap_model", "Trainer._save"}
    by_class = "from paddlenlp.trainer import Trainer\n" + mixin + "class T(Mixin, Trainer):\n    pass\n"
    assert overrides_in(by_class) == {"Trainer._wrap_model"}
    imported = ("from paddlenlp.trainer import Trainer\nfrom training.semi_auto import SemiAutoMethods\n"
                "T = type('T', (SemiAutoMethods, Trainer), {})\n")
    assert "Trainer._nested_gather" in overrides_in(imported)
    assert overrides_in(mixin) == set()  # (a class of ours joined to nothing of theirs overrides nothing)


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
