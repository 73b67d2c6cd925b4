"""Serving stage: Paddle Serving Pipeline service for an export directory, its client, start/stop/smoke.
Paddle Serving 0.9.0's platform workarounds are applied here, once, for everything under serving/
(core/workarounds/paddle_serving.py)."""
import core  # noqa: F401  (zlib before paddle)
from core.workarounds import paddle_serving as _paddle_serving

_paddle_serving.apply()
