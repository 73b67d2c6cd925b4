"""The import graph is a stack of packages (docs/architecture.md): parsed from the source of every module,
lazy imports included.

    top      bench/ (the benchmark suite: drives the verbs)
             pipeline/ (the verbs, one module each; pipeline/runner/: what they share that belongs to no stage)
             export/ (checkpoint -> export directory, checked with serving's runtime)   evaluation/ (a version judged)
    stages   training/                    serving/          (neither imports the other)
             model/ (the model: training and export build it)
    bottom   core/ (shared vocabulary, platform workarounds: imports nothing above it)

Inside serving/, protocol.py is the bottom (it imports nothing of serving/), and the engine (serving/engine/) imports
only it and state.py, never the processes above it (server/, client/, offline/, controller.py). Inside pipeline/,
every top-level module is a verb and the machinery never imports a verb.

A module's layer is its package's; a new package must be given a layer here (the test says so).
"""
import ast
import re
from pathlib import Path

import pytest

from core import REPO_ROOT
LAYERS = {"core": 0, "model": 1, "training": 2, "serving": 2, "export": 3, "evaluation": 3, "pipeline": 4, "bench": 5}
PACKAGES = tuple(LAYERS)


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    return ".".join(parts[:-1]) if parts[-1] == "__init__" else ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in (REPO_ROOT / pkg).rglob("*.py")}


def imports_of(path: Path, known: set[str]) -> set[str]:
    """Internal modules `path` imports anywhere: module level, inside functions, and under `if TYPE_CHECKING:` (an
    import for annotations is a dependency too: two modules that name each other's types are one module, or a
    third holds what both need)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from pipeline import tracking` imports the module core.tracking
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                     for a in node.names]
        else:
            continue
        found.update(n for n in names if n.split(".")[0] in PACKAGES)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports_of(path, set(mods)) - {name} for name, path in mods.items()}


def layer(name: str) -> int:
    return LAYERS[name.split(".")[0]]


def test_the_parser_sees_lazy_and_from_imports(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("from typing import TYPE_CHECKING\nimport pipeline\nfrom core import tracking\n"
                      "def f():\n    from serving.engine.exported import ExportedModel\n"
                      "if TYPE_CHECKING:\n    from training import data\n")
    assert imports_of(source, {"core.tracking", "training.data"}) == {"pipeline", "core.tracking",
                                                                      "serving.engine.exported",
                                                                      "training.data"}


def test_a_cycle_through_an_annotation_import_is_a_cycle(tmp_path):
    """(the config and its value checks were once two modules that imported each other, one side under TYPE_CHECKING,
    unseen by this test)"""
    (tmp_path / "a.py").write_text("from core import b\n")
    (tmp_path / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from core import a\n")
    known = {"core.a", "core.b"}
    assert imports_of(tmp_path / "b.py", known) == {"core.a"} and imports_of(tmp_path / "a.py", known) == {"core.b"}


def test_every_package_has_a_layer():
    packages = {p.parent.name for p in REPO_ROOT.glob("*/__init__.py")} - {"tests"}
    assert packages == set(LAYERS), f"give each package a layer in LAYERS: {packages ^ set(LAYERS)}"


def violations(g: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Imports that go up or sideways: allowed are imports within a package and into a lower layer."""
    return [(m, i) for m, deps in g.items() for i in deps
            if i.split(".")[0] != m.split(".")[0] and layer(i) >= layer(m)]


def test_imports_only_go_down():
    wrong = violations(graph())
    assert not wrong, wrong


def test_the_layer_rule_catches_upward_and_sideways_imports():
    g = {"core.config": {"training.data"}, "training.data": {"serving.engine.exported", "core.layout"},
         "serving.engine.exported": {"core.exportdir"}, "pipeline.train": {"bench.suite", "training.rank"},
         "bench.suite": {"pipeline.plan"}}
    assert sorted(violations(g)) == [("core.config", "training.data"), ("pipeline.train", "bench.suite"),
                                     ("training.data", "serving.engine.exported")]


SERVING_BELOW_ENGINE = ("serving.protocol", "serving.state", "serving")  # (serving/__init__: its workarounds)


def serving_order_violations(g: dict[str, set[str]]) -> list[tuple[str, str]]:
    """protocol imports nothing of serving/; the engine imports only the engine, protocol and state."""
    wrong = [(m, i) for m, deps in g.items() if m == "serving.protocol" for i in deps
             if i.startswith("serving.") or i == "serving"]
    wrong += [(m, i) for m, deps in g.items() if m.startswith("serving.engine") for i in deps
              if i.split(".")[0] == "serving" and not i.startswith("serving.engine") and i not in SERVING_BELOW_ENGINE]
    return wrong


def test_serving_protocol_is_the_bottom_and_the_engine_never_imports_the_processes_above_it():
    wrong = serving_order_violations(graph())
    assert not wrong, wrong


def test_the_serving_order_rule_catches_a_wrong_import():
    g = {"serving.protocol": {"serving.engine.generation", "core.config"},
         "serving.engine.worker": {"serving.protocol", "serving.server.metrics", "serving.engine.runtime"},
         "serving.engine.dispatch": {"serving.state", "serving.controller"}}
    assert sorted(serving_order_violations(g)) == [
        ("serving.engine.dispatch", "serving.controller"), ("serving.engine.worker", "serving.server.metrics"),
        ("serving.protocol", "serving.engine.generation")]


def test_pipeline_holds_verbs_and_its_machinery_never_imports_one():
    """Every module directly in pipeline/ is a verb (`python -m pipeline <verb>`), named after it; what they share
    lives in pipeline/runner/; no verb is imported by another verb or by the machinery."""
    from pipeline.__main__ import VERBS

    top = {p.stem for p in (REPO_ROOT / "pipeline").glob("*.py")} - {"__init__", "__main__"}
    assert top == set(VERBS.values()), f"not verbs: {sorted(top - set(VERBS.values()))}; " \
                                       f"verbs without a module: {sorted(set(VERBS.values()) - top)}"
    wrong = verb_import_violations(graph(), {f"pipeline.{m}" for m in top})
    assert not wrong, wrong


def verb_import_violations(g: dict[str, set[str]], verbs: set[str]) -> list[tuple[str, str]]:
    """A verb or the machinery importing a verb: what two verbs share belongs in pipeline/runner/."""
    return [(m, i) for m, deps in g.items() if m.startswith("pipeline.") for i in deps if i in verbs and i != m]


def test_the_verb_rule_catches_a_verb_importing_a_verb():
    verbs = {"pipeline.train", "pipeline.finetune", "pipeline.export"}
    g = {"pipeline.finetune": {"pipeline.train", "training.launch.train_run"}, "pipeline.export": {"core.tracking"},
         "pipeline.runner.comparison": {"pipeline.export"}, "pipeline.__main__": {"core.config"}}
    assert sorted(verb_import_violations(g, verbs)) == [("pipeline.finetune", "pipeline.train"),
                                                        ("pipeline.runner.comparison", "pipeline.export")]


def test_every_internal_import_names_a_module_that_exists():
    """(a lazy import of a moved module fails only when its function runs: caught here instead)"""
    known = set(modules())
    missing = [(m, i) for m, deps in graph().items() for i in deps if i not in known]
    assert not missing, missing


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
    """The Makefile calls `python -m pipeline <verb>`; each verb is one pipeline/ module with `main(config, args)`,
    and README's verb table has a row for each."""
    import importlib

    from pipeline.__main__ import VERBS, parser

    verbs = set(parser()._subparsers._group_actions[0].choices)
    assert verbs == set(VERBS)
    makefile = (REPO_ROOT / "Makefile").read_text()
    readme_verbs = set(re.findall(r"^\| `make ([a-z-]+)", (REPO_ROOT / "README.md").read_text(), re.M))
    readme_verbs |= set(re.findall(r"^\| `make [a-z-]+[^|]*` / `make ([a-z-]+)", (REPO_ROOT / "README.md").read_text(),
                                   re.M))
    for verb in verbs:
        assert f"-m pipeline {verb}" in makefile, verb
        assert callable(importlib.import_module(f"pipeline.{VERBS[verb]}").main), verb
        assert verb in readme_verbs, f"README's verb table has no row for make {verb}"


def long_functions(paths) -> list[str]:
    long = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                long.append(f"{path.relative_to(REPO_ROOT)}:{node.name} ({node.end_lineno - node.lineno + 1} lines)")
    return long


def test_every_verb_without_required_arguments_gets_its_config():
    """(`make mlflow-server` once failed here: its parser has no --config)"""
    from pipeline.__main__ import VERBS, parser, verb_config

    for verb in sorted(VERBS):
        try:
            args = parser().parse_args([verb])
        except SystemExit:  # (a verb with required arguments, e.g. generate's --input)
            continue
        assert verb_config(args).name, verb


def test_no_function_is_longer_than_60_lines():
    """(a function that does not fit on a screen is a function to split; tests included)"""
    long = long_functions([*modules().values(), *sorted((REPO_ROOT / "tests").rglob("*.py"))])
    assert not long, long


def test_a_verb_declares_its_arguments_beside_its_main_and_only_its_module_is_loaded():
    """Adding a verb is its module (HELP, arguments, main) and a VERBS entry; parsing one verb's command line imports
    that verb's module and no other verb's."""
    import subprocess
    import sys

    from pipeline.__main__ import VERBS, module_of, parser

    for verb in VERBS:
        module = module_of(verb)
        assert module.HELP and callable(module.main), verb
    assert parser("train").parse_args(["train", "--resume", "r1", "training.max_steps=3"]).overrides == \
        ["training.max_steps=3"]
    code = ("import sys; from pipeline.__main__ import parser; parser('stop').parse_args(['stop']); "
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('pipeline.') and 'runner' not in m)))")
    loaded = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert loaded.stdout.split() == ["pipeline.__main__", "pipeline.stop"], loaded.stdout


# "Is this a fine-tuning run?" is asked one way: Config.fine_tuning (a run's config), exportdir.fine_tuned (an
# export's export.json); these are the other ways it was once asked (finetune.data's truth, export.json's
# finetune_data, the examples' stats kind)
FINE_TUNING_ASKED = (r"\b(if|and|not)\s+[\w.]*finetune\.data\b(?!\s*[!=]=)", r"[\w.]*finetune\.data\s+(if|else|and)\b",
                     r"\bif\s+(not\s+)?f\.data\b(?!\s*[!=]=)", r"\bf\.data\s+and\b", r"get\(\"finetune_data\"\)",
                     r"\"kind\"\)\s*==\s*\"sft\"")
FINE_TUNING_OWNERS = ("core/config.py", "core/exportdir.py")


def fine_tuning_asked_elsewhere(sources: dict[str, str]) -> list[str]:
    return sorted(f"{name}:{n}" for name, text in sources.items() if name not in FINE_TUNING_OWNERS
                  for n, line in enumerate(text.splitlines(), 1) if any(re.search(p, line) for p in FINE_TUNING_ASKED))


def test_fine_tuning_is_asked_one_way():
    sources = {p.relative_to(REPO_ROOT).as_posix(): p.read_text(encoding="utf-8") for p in modules().values()}
    assert fine_tuning_asked_elsewhere(sources) == []
    planted = {"a.py": "    if config.finetune.data:\n", "b.py": "x = 1 if cfg.finetune.data else 2\n",
               "c.py": "    if meta.get(\"finetune_data\"):\n", "d.py": "    if f.data and not init:\n",
               "e.py": "    if config.finetune.data == \"reviews\":\n",
               "core/config.py": "    if config.finetune.data:\n", "f.py": "    return json.loads(t).get(\"kind\") == \"sft\"\n"}
    assert fine_tuning_asked_elsewhere(planted) == ["a.py:1", "b.py:1", "c.py:1", "d.py:1", "f.py:1"]


def test_no_launcher_under_pipeline():
    """A training run's launcher is training/launch/ (it starts the ranks); pipeline/ only calls it."""
    sources = {p.relative_to(REPO_ROOT).as_posix(): p.read_text(encoding="utf-8") for p in modules().values()}
    assert launchers_in_pipeline(sources) == []
    planted = {"pipeline/runner/ranks.py": "cmd = [sys.executable, '-m', 'paddle.distributed.launch', rank]\n",
               "pipeline/train.py": "subprocess.Popen([python, str(REPO_ROOT / 'training' / 'rank.py')])\n",
               "training/launch/supervise.py": "'-m', 'paddle.distributed.launch'\n"}
    assert launchers_in_pipeline(planted) == ["pipeline/runner/ranks.py", "pipeline/train.py"]


def launchers_in_pipeline(sources: dict[str, str]) -> list[str]:
    starts_ranks = re.compile(r"paddle\.distributed\.launch|['\"]rank\.py['\"]|training\.rank['\"]")
    return sorted(name for name, text in sources.items() if name.startswith("pipeline/") and starts_ranks.search(text))


# A task's answers are graded in one place (evaluation/grading.py task_accuracy): make evaluate and the smoke test
# once computed the accuracy each their own way, with different figures.
GRADING = re.compile(r"\bdef \w*accuracy\w*\(|==\s*\w+\[[\"']answer[\"']\]|\[[\"']answer[\"']\]\s*==")


def graded_elsewhere(sources: dict[str, str]) -> list[str]:
    return sorted(f"{name}:{n}" for name, text in sources.items() if name != "evaluation/grading.py"
                  for n, line in enumerate(text.splitlines(), 1) if GRADING.search(line))


def test_one_task_accuracy_function():
    sources = {p.relative_to(REPO_ROOT).as_posix(): p.read_text(encoding="utf-8") for p in modules().values()}
    assert graded_elsewhere(sources) == []
    assert all("task_accuracy(" in sources[verb] for verb in ("pipeline/evaluate.py", "pipeline/smoke.py"))
    planted = {"pipeline/smoke.py": "    right = sum(a == t[\"answer\"] for a, t in zip(answers, task))\n",
               "pipeline/evaluate.py": "def task_accuracy(export_dir, task):\n",
               "evaluation/grading.py": "def task_accuracy(task, answers):\n"}
    assert graded_elsewhere(planted) == ["pipeline/evaluate.py:1", "pipeline/smoke.py:1"]
