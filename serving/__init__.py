"""Serving stage: an export directory behind an endpoint; each folder is named by the process that runs it.

    protocol.py   the one request protocol (fields, limits, errors, generation settings): the bottom of serving/
    engine/       generation: the scheduler, the worker process (engine/worker.py), the dispatcher over workers
    server/       the server process (server/main.py): Paddle Serving's Op, the OpenAI routes, metrics, follower
    controller.py starts and stops that process, in the `make serve` / `make stop` process; state.py is where a
                  running server records itself
    client/       the caller's process: the Python client (HTTP / gRPC) and `make smoke`
    offline/      generation with no server, in the caller's process: batch tables (`make generate`) and the
                  MLflow `python_function` model

Paddle Serving 0.9.0's platform workarounds are applied here, once, for everything under serving/
(core/workarounds/paddle_serving.py)."""
import core  # noqa: F401  (zlib before paddle)
from core.workarounds import paddle_serving as _paddle_serving

_paddle_serving.apply()
