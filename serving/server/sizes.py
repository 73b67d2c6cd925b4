"""How big the server process is, from the typed config: its generation workers, requests in flight, predictor
threads, and Paddle Serving's rendered config.yml (read by the server process and by serving/controller.py, which
writes it)."""
from __future__ import annotations

from serving.engine.dispatch import per_worker_capacity
from serving.engine.placement import worker_count


def workers(serving_config) -> int:
    """Generation worker processes: serving.workers, or (0) one per core this server may use (one per GPU on
    serving.device=gpu: serving/engine/placement.py)."""
    return worker_count(serving_config)


def capacity(serving_config) -> int:
    """Requests in flight at most: each worker's running batch and queue (serving/engine/dispatch.py)."""
    n = workers(serving_config)
    return n * per_worker_capacity(serving_config, n)


def predictor_threads(serving_config) -> int:
    """Math threads of each worker's predictors: serving.predictor_threads, or (0) an even share of the cores (1 on
    GPU: the host only feeds the device)."""
    from core.workarounds import cpu_runtime

    if serving_config.device == "gpu":
        return 1
    return cpu_runtime.threads_per_process(serving_config.predictor_threads, workers(serving_config))


def render_config(config) -> dict:
    """Paddle Serving's config.yml, from the typed config: thread Ops, one per request in flight (plus a few, so that
    one more request reaches the busy check instead of queueing inside Paddle Serving), no auto-batching."""
    s = config.serving
    threads = capacity(s) + 4
    return {
        "worker_num": s.rpc_workers or threads,  # gRPC threads: fewer would queue requests unseen
        "build_dag_each_worker": False,
        "rpc_port": s.rpc_port,
        "http_port": s.http_port,
        "dag": {"is_thread_op": True, "retry": 1, "use_profile": False, "tracer": {"interval_s": -1}},
        "op": {
            s.service_name: {
                "concurrency": threads,
                "timeout": -1,
                "retry": 1,
                "batch_size": 1,  # (the worker batches; Paddle Serving's auto-batching would only add a wait)
                "auto_batching_timeout": -1,
                "local_service_conf": {},  # no model or client type: the worker process holds the model
            }
        },
    }
