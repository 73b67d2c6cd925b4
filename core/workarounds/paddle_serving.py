"""Paddle Serving 0.9.0 on Python 3.11 (applied by `serving/__init__.py`, for everything under serving/).

- paddle_serving_server 0.9.0 imports `paddle_serving_client` at load time, which has no Python 3.11 build: the
  stand-in in core/workarounds/serving_compat/ is put on sys.path when the real package is absent;
- importing paddle_serving_server.pipeline (the gRPC client too) creates PipelineServingLogs/ in the current
  directory unless SERVING_LOG_PATH says where: clients log under the temp directory, the server (serving/server.py)
  into its state directory.
"""
import importlib.util
import os
import sys
import tempfile
from pathlib import Path

COMPAT_DIR = Path(__file__).resolve().parent / "serving_compat"


def apply() -> None:
    if importlib.util.find_spec("paddle_serving_client") is None and str(COMPAT_DIR) not in sys.path:
        sys.path.append(str(COMPAT_DIR))
    os.environ.setdefault("SERVING_LOG_PATH", os.path.join(tempfile.gettempdir(), "paddle-serving-client"))
