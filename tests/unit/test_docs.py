"""Docs that cannot drift: every config key is in README's configuration reference, and every module of the code is
in docs/architecture.md's module map."""
import dataclasses
import re

from core import REPO_ROOT
from core.config import Config

README = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
ARCHITECTURE = (REPO_ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")


def reference_rows() -> dict[str, str]:
    """README's `| `section` | keys ... |` rows of the config reference."""
    table = README.split("## Config reference", 1)[1].split("\n## ", 1)[0]
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


def test_every_module_is_in_the_architecture_map():
    missing = []
    packages = sorted(p.parent.name for p in REPO_ROOT.glob("*/__init__.py") if p.parent.name != "tests")
    assert {"core", "model", "training", "serving", "export", "pipeline", "bench"} <= set(packages)
    for package in packages:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            if "serving_compat" in path.parts or path.name in ("__init__.py", "__main__.py"):
                continue
            name = path.stem
            if not re.search(rf"\b{re.escape(name)}\b", ARCHITECTURE):
                missing.append(str(path.relative_to(REPO_ROOT)))
    assert not missing, f"not in docs/architecture.md's module map: {', '.join(missing)}"
