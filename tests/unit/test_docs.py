"""Docs that cannot drift: every config key is in README's configuration reference with its declared default and
allowed values (core/config.py `option`), and every module of the code is in docs/architecture.md's
module map."""
import dataclasses
import re

from core import REPO_ROOT
from core.config import Config, declared

README = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
ARCHITECTURE = (REPO_ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")


def reference_rows(readme: str = README) -> dict[str, str]:
    """README's `| `section` | keys ... |` rows of the config reference."""
    table = readme.split("## Config reference", 1)[1].split("\n## ", 1)[0]
    return {m.group(1): m.group(2) for m in re.finditer(r"^\| `(\w+)` \| (.*)\|$", table, re.M)}


def test_every_config_key_is_in_the_configuration_reference():
    rows = reference_rows()
    missing = []
    for section in dataclasses.fields(Config):
        if not dataclasses.is_dataclass(section.type if not isinstance(section.type, str) else
                                        getattr(Config(), section.name)):
            continue
        row = rows.get(section.name, "")
        for key in dataclasses.fields(getattr(Config(), section.name)):
            if f"`{key.name}`" not in row:
                missing.append(f"{section.name}.{key.name}")
    assert not missing, f"not in README's config reference: {', '.join(missing)}"


def declarations() -> dict[str, dict[str, dict]]:
    """section -> key -> its declared default and rules."""
    return {f.name: declared(type(getattr(Config(), f.name))) for f in dataclasses.fields(Config)
            if dataclasses.is_dataclass(getattr(Config(), f.name))}


def _parenthesis(row: str, key: str) -> str | None:
    """What README says in the parenthesis right after `key`, nested ones included."""
    found = re.search(rf"`{key}` \(", row)
    if not found:
        return None
    depth, end = 1, found.end()
    while depth and end < len(row):
        depth += {"(": 1, ")": -1}.get(row[end], 0)
        end += 1
    return row[found.end():end - 1]


def _literal(text: str, default):
    """The parenthesis' first clause read as a value of the default's type; None when it is prose."""
    word = text.strip().strip("`")
    if isinstance(default, bool):
        return {"true": True, "false": False}.get(word)
    if isinstance(default, (int, float)):
        try:
            return type(default)(float(word))
        except ValueError:
            return None
    if isinstance(default, str):
        return "" if word == '""' else word if re.fullmatch(r"[\w.@/+-]+", word) else None
    return None


def reference_mismatches(readme: str, sections: dict[str, dict[str, dict]]) -> list[str]:
    """A key's parenthesis in README begins with its allowed values (`a/b/c`, the default first) when it has some,
    else with its default where it gives one as a value (`(8)`, `(true)`, `("")`); either must be the declared one."""
    rows, wrong = reference_rows(readme), []
    for section, keys in sections.items():
        for key, declared_as in keys.items():
            text = _parenthesis(rows.get(section, ""), key)
            if text is None:
                wrong += [f"{section}.{key}: no (allowed values)"] if "allowed" in declared_as else []
                continue
            clause = re.split(r"[:;]| = |, ", text, maxsplit=1)[0]
            if "allowed" in declared_as:
                said = [v.strip().strip("`").strip() for v in clause.split("/")]
                if said != list(declared_as["allowed"]):
                    wrong.append(f"{section}.{key}: README says {'/'.join(said)}, declared "
                                 f"{'/'.join(declared_as['allowed'])}")
            elif _literal(clause, declared_as["default"]) not in (None, declared_as["default"]):
                wrong.append(f"{section}.{key}: README says {clause}, declared default {declared_as['default']!r}")
    return wrong


def test_the_configuration_reference_gives_the_declared_defaults_and_allowed_values():
    assert reference_mismatches(README, declarations()) == []


def test_the_reference_check_sees_a_wrong_value_planted_on_either_side():
    sections = declarations()
    assert reference_mismatches(README.replace("`lora_rank` (8)", "`lora_rank` (9)"), sections) == [
        "finetune.lora_rank: README says 9, declared default 8"]
    assert reference_mismatches(README.replace("(cosine/linear/constant)", "(cosine/linear/step)"), sections) == [
        "training.lr_scheduler: README says cosine/linear/step, declared cosine/linear/constant"]
    planted = {**sections, "serving": {**sections["serving"], "scheduler": {
        "default": "continuous", "allowed": ("continuous", "static", "priority")}}}
    assert reference_mismatches(README, planted) == [
        "serving.scheduler: README says continuous/static, declared continuous/static/priority"]


def module_map(text: str) -> set[str]:
    """The modules docs/architecture.md's module map has a row for (`| `path.py` | ... |`)."""
    table = text.split("## Module map", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `([\w/]+\.py)` \|", table, re.M))


def code_modules() -> set[str]:
    packages = sorted(p.parent.name for p in REPO_ROOT.glob("*/__init__.py") if p.parent.name != "tests")
    assert {"core", "model", "training", "serving", "export", "pipeline", "bench"} <= set(packages)
    return {str(path.relative_to(REPO_ROOT)) for package in packages for path in (REPO_ROOT / package).rglob("*.py")
            if "serving_compat" not in path.parts and path.name != "__init__.py"}


def test_every_module_is_in_the_architecture_map():
    mapped, modules = module_map(ARCHITECTURE), code_modules()
    assert not modules - mapped, f"not in docs/architecture.md's module map: {', '.join(sorted(modules - mapped))}"
    assert not mapped - modules, f"in the module map but gone: {', '.join(sorted(mapped - modules))}"


def test_the_module_map_check_sees_a_removed_row():
    """(prose that mentions a module is not a row of the map)"""
    row = "| `pipeline/train.py` | `make train` |\n"
    assert row in ARCHITECTURE
    broken = ARCHITECTURE.replace(row, "") + "\nThe verb pipeline/train.py launches ranks; train.py is a verb.\n"
    assert "pipeline/train.py" in code_modules() - module_map(broken)


def makefile_targets() -> dict[str, str]:
    """Each Makefile target and its recipe."""
    text = (REPO_ROOT / "Makefile").read_text(encoding="utf-8")
    return {m.group(1): m.group(2) for m in re.finditer(r"^([a-z][a-z-]*):[^\n=]*\n((?:\t[^\n]*\n)*)", text, re.M)}


def not_the_pipeline(targets: dict[str, str], readme: str) -> list[str]:
    """Targets whose recipe is neither `python -m pipeline <verb>` nor other make targets, and which README's sentence
    on the rest of the Makefile does not name."""
    rest = readme.split("The rest of the Makefile is not the pipeline:", 1)[1].split("\n", 1)[0]
    return sorted(t for t, recipe in targets.items() if f"-m pipeline {t}" not in recipe
                  and "$(MAKE)" not in recipe and f"`{t}`" not in rest)


def test_readme_says_which_targets_are_not_python_m_pipeline():
    """(README once said every target but bench went through python -m pipeline)"""
    targets = makefile_targets()
    assert {"train", "test", "mlflow-ui", "bench"} <= set(targets)
    assert not_the_pipeline(targets, README) == []
    assert not_the_pipeline(targets, README.replace("`mlflow-ui`", "mlflow-ui")) == ["mlflow-ui"]


# A path of this repository named in the code, the docs, the configs or the Makefile, optionally followed by a name in
# it (`core/config.py Config`, training/rank.py `training_arguments`): the file exists and defines the name.
POINTER = re.compile(r"(?<![\w./<>@-])((?:core|training|serving|pipeline|model|export|evaluation|bench|tests|configs|docs|"
                     r"deploy|requirements|\.ci)/[\w./-]*\.(?:py|md|yaml|yml|json|sh|txt|toml|conf|html))(?![\w<>/])"
                     r"(?: `?([A-Z][A-Za-z0-9_]+|[a-z_][a-z0-9_]{2,})`?)?")
# (a missing file named on purpose: the test of a config that does not exist, a planted example of a rule's test)
NOT_FILES = {("tests/unit/test_config.py", "configs/nope.yaml"), ("tests/unit/test_layers.py", "pipeline/runner/ranks.py")}
PLANTED = "tests/unit/test_docs.py"  # (this file: its planted examples)


def false_pointers(texts: dict[str, str], exists, defines) -> list[str]:
    wrong = []
    for name, text in texts.items():
        for found in POINTER.finditer(text):
            path, symbol = found.group(1).rstrip("."), found.group(2)
            if (name, path) in NOT_FILES:
                continue
            if not exists(path):
                wrong.append(f"{name}: {path} does not exist")
            elif symbol and path.endswith(".py") and (symbol[0].isupper() or "`" in found.group(0)) \
                    and not defines(path, symbol):
                wrong.append(f"{name}: {path} has no {symbol}")
    return sorted(set(wrong))


def _defines(path: str, symbol: str) -> bool:
    text = (REPO_ROOT / path).read_text(encoding="utf-8")
    return re.search(rf"^\s*(?:async )?(?:def|class) {symbol}\b|^\s*(?:\w+\s*,\s*)*{symbol}\s*(?:,\s*\w+\s*)*[:=]",
                     text, re.M) is not None


def test_every_file_the_code_and_docs_point_at_exists_and_has_the_name():
    import subprocess

    tracked = subprocess.run(["git", "ls-files"], cwd=REPO_ROOT, capture_output=True, text=True).stdout.split()
    texts = {f: (REPO_ROOT / f).read_text(encoding="utf-8") for f in tracked
             if f.endswith((".py", ".md", ".yaml", ".toml", ".sh", ".txt")) or f == "Makefile"
             if not f.startswith("mlflow/") and f != PLANTED and (REPO_ROOT / f).is_file()}
    assert false_pointers(texts, lambda p: (REPO_ROOT / p).exists(), _defines) == []


def test_the_pointer_check_sees_a_moved_file_and_a_renamed_name():
    texts = {"a.py": "# (VisualDL's writers: training/monitor.py)\n",
             "b.md": "see `core/config.py Config` and core/config.py `check_everything`\n"}
    assert false_pointers(texts, lambda p: (REPO_ROOT / p).exists(), _defines) == [
        "a.py: training/monitor.py does not exist", "b.md: core/config.py has no check_everything"]
