"""Orchestration of the train-to-serve pipeline: typed config, parallel layout, stage entry points.

Platform rule, kept in this one place: `zlib` must be loaded before anything imports paddle. libpaddle.so (Paddle 2.6.2)
exports its own zlib symbols; if it is loaded first, later zlib users (grpc, safetensors, zip files) fail with
"inconsistent stream state" or segfault. `training` and `serving` import this package first, and so do the tests.
The CPU math library's environment is set here too, for the same reason (it must precede paddle: see cpu_runtime).
"""
import zlib  # noqa: F401  (see the docstring: must precede every `import paddle`)

from pipeline import cpu_runtime as _cpu_runtime

_cpu_runtime.prepare_process()

import warnings as _warnings

# Warnings known to be harmless here, silenced where every process starts (anything else still shows):
for _message in (
    "Setuptools is replacing distutils",  # setuptools' shim, triggered by paddle's `import distutils`
    r"The Attr\(force_cpu\) of Op\(fill_constant\)",  # Paddle 2.6.2's own ops in dy2static export programs
    "paddle.assign doesn't support float64",  # export: rotary tables are float32 anyway
    "the input shapes of select_input should have the same rank",  # dy2static control flow in PaddleNLP's Llama
):
    _warnings.filterwarnings("ignore", message=_message)

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
