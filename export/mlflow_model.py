"""The export directory as an MLflow `python_function` model, in place: MLflow's metadata next to the programs
(serving/offline/pyfunc.py is the model class MLflow loads), and `check`, which loads it as MLflow does."""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import serving  # noqa: F401,I001  (first: zlib before paddle; the paddle_serving_client stand-in)
import mlflow.pyfunc

from serving.offline.pyfunc import EXPORT_ARTIFACT, GenerationModel, signature


def write(export_dir: Path, pip_requirements: list[str], input_prompt: str) -> None:
    """Add MLflow's metadata for a `python_function` model to an export directory, in place.

    MLflow's `save_model` copies artifacts into the model directory; an export is tens of MB to TBs, so the model
    is saved with a placeholder artifact in a scratch directory, its metadata moved into the export directory, and
    the artifact's path set to `.` (the model's own root), which is where pyfunc resolves artifacts from."""
    from mlflow.models import Model

    repo = Path(serving.__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory(prefix="pyfunc-") as scratch:
        placeholder = Path(scratch) / "placeholder"
        placeholder.mkdir()
        code = []  # the serving code and the vocabulary it imports (core/), without bytecode caches
        for package in ("serving", "core"):
            code.append(shutil.copytree(repo / package, Path(scratch) / "code" / package,
                                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc")))
        model_dir = Path(scratch) / "model"
        mlflow.pyfunc.save_model(
            str(model_dir), python_model=GenerationModel(), artifacts={EXPORT_ARTIFACT: str(placeholder)},
            code_paths=[str(c) for c in code], pip_requirements=pip_requirements,
            signature=signature(), input_example={"prompt": input_prompt, "max_new_tokens": 8})
        shutil.rmtree(model_dir / "artifacts")
        model = Model.load(str(model_dir))
        model.flavors["python_function"]["artifacts"][EXPORT_ARTIFACT]["path"] = "."
        model.save(str(model_dir / "MLmodel"))
        for item in model_dir.iterdir():
            target = Path(export_dir) / item.name
            if target.exists():
                raise FileExistsError(f"{target} exists: the export directory already holds an MLflow model")
            shutil.move(str(item), target)


# Not needed to generate, and their declared pins cannot install on Python 3.11 (the project installs them with
# --no-deps): left out, so that pip can resolve the rest when `mlflow models serve` builds an environment.
NOT_FOR_PYFUNC = ("paddle-serving-server", "paddle-serving-app")


def pinned_requirements(repo: Path) -> list[str]:
    """The project's exact pins (requirements/lock.txt plus the CPU Paddle build) but Paddle Serving's: what
    `mlflow models serve` installs when it builds an environment."""
    lines = []
    for name in ("lock.txt", "paddle-cpu.txt"):
        for line in (repo / "requirements" / name).read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if line and not line.startswith("-") and not line.lower().startswith(NOT_FOR_PYFUNC):
                lines.append(line)
    return lines


def check(export_dir: Path, references: dict[str, list[int]]) -> dict[str, list[int]]:
    """Load the directory as MLflow would (`mlflow.pyfunc.load_model`) and generate the reference prompts greedily;
    returns the prompts whose tokens differ (empty when the model answers as recorded)."""
    import pandas as pd

    model = mlflow.pyfunc.load_model(str(export_dir))
    prompts = list(references)
    n = max(len(v) for v in references.values())
    out = model.predict(pd.DataFrame({"prompt": prompts, "max_new_tokens": [n] * len(prompts)}))
    return {p: list(map(int, ids)) for p, ids in zip(prompts, out["token_ids"]) if list(map(int, ids)) != references[p]}
