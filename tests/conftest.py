import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pipeline  # noqa: E402,F401  (zlib before paddle, for every test)
import pytest  # noqa: E402

from helpers import TINY_CONFIG  # noqa: E402


@pytest.fixture
def store_uri(tmp_path) -> str:
    """A fresh SQLite MLflow store for one test."""
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


@pytest.fixture
def tiny_config(tmp_path) -> Path:
    path = tmp_path / "tiny-test.yaml"
    path.write_text(TINY_CONFIG + f"\n# runs of this test go under its temporary directory\n")
    return path
