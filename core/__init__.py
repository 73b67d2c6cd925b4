"""The bottom layer: the vocabulary every part of the pipeline shares, importing nothing above it.

    config      the one typed config (YAML + overrides, validated before anything starts)
    layout      the hybrid-parallel layout (degrees, ranks, stages), validated
    arithmetic  the model's parameter count, FLOPs and memory (layout, plan and bench use it)
    schedules   pipeline schedules (1F1B, interleaved, F-then-B) and their bubbles
    tracking    MLflow names, URIs, clients and the buffered records of an outage
    exportdir   the export-directory contract between export (writer) and serving (reader)
    tokenizer   the saved tokenizer's format
    processes   process groups, ports, signals
    errors      ConfigError: a wrong setting, reported in one line before launch
    files       atomic writes (temp file, fsync, rename, fsync the directory)
    registry    models:/ URIs -> a local export directory
    cluster     Ray (one init) for data preparation and batch generation
    dataset     the prepared data set's format: token shards, manifest
    workarounds every Paddle / PaddleNLP / Paddle Serving workaround, each naming its bug and versions

Importing this package applies the process-wide workarounds first (zlib before paddle, the CPU math runtime, known
harmless warnings): `training`, `serving`, `pipeline`, `bench` and the tests import it before anything else.
"""
import zlib  # noqa: F401  (must precede every `import paddle`: see core/workarounds/__init__.py)

from core import workarounds as _workarounds

_workarounds.apply_process_wide()

from pathlib import Path  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
