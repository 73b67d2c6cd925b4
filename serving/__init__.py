"""Serving stage: an export directory behind an endpoint. engine/ generates (scheduler, workers, dispatch);
entrypoints/ face users (Paddle Serving's Op, the OpenAI routes, the MLflow model, client, start/stop/smoke);
protocol.py is the one request protocol between them, state.py where a running server records itself.
Paddle Serving 0.9.0's platform workarounds are applied here, once, for everything under serving/
(core/workarounds/paddle_serving.py)."""
import core  # noqa: F401  (zlib before paddle)
from core.workarounds import paddle_serving as _paddle_serving

_paddle_serving.apply()
