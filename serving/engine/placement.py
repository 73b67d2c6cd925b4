"""Where each generation worker runs: CPU (an even share of the cores) or one GPU, and at which precision.

    serving.device=cpu   serving.workers (0 = one per core), each with `predictor_threads` math threads
    serving.device=gpu   serving.workers (0 = one per GPU of serving.gpus, [] = every visible GPU), worker i on
                         gpus[i % n]; predictors built with enable_use_gpu(gpu_memory_mb, device id, precision)

A reduced precision (float16 / bfloat16) is checked when a worker starts: the full-sequence graph's logits on a fixed
input at that precision against float32 on the same GPU, within PRECISION_TOLERANCE (the parity gate of export is
float32 against the dynamic model; this is its counterpart for what the worker actually runs).
"""
from __future__ import annotations

import os
import shutil
import subprocess

import numpy as np

from core.errors import ConfigError
from serving.engine.runtime import Placement

# Max |logit difference| against float32 accepted at a worker's start (float16 keeps ~3 decimal digits, bfloat16 ~2).
PRECISION_TOLERANCE = {"float16": 5e-2, "bfloat16": 2.5e-1}


def visible_gpus() -> list[int]:
    """Indices this process may use: CUDA_VISIBLE_DEVICES (renumbered from 0, as CUDA does), else nvidia-smi's list."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return list(range(len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])))
    if not shutil.which("nvidia-smi"):
        return []
    proc = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    return list(range(len([line for line in proc.stdout.splitlines() if line.startswith("GPU ")])))


def gpus(serving_config) -> list[int]:
    found = visible_gpus()
    chosen = list(serving_config.gpus) or found
    if not chosen:
        raise ConfigError("serving.device=gpu: no GPU visible (nvidia-smi lists none, or CUDA_VISIBLE_DEVICES is "
                          "empty); check `make doctor`, or serving.device=cpu")
    missing = [g for g in chosen if g not in found]
    if missing:
        raise ConfigError(f"serving.gpus: {missing} not among the {len(found)} visible GPU(s) {found}")
    return chosen


def worker_count(serving_config) -> int:
    if serving_config.workers:
        return serving_config.workers
    if serving_config.device == "gpu":
        return len(gpus(serving_config))
    from core.workarounds import cpu_runtime

    return cpu_runtime.available_cores()


def placements(serving_config) -> list[Placement]:
    """One placement per worker, in worker order."""
    n = worker_count(serving_config)
    if serving_config.device != "gpu":
        return [Placement()] * n
    chosen = gpus(serving_config)
    return [Placement("gpu", chosen[i % len(chosen)], serving_config.gpu_memory_mb, serving_config.precision)
            for i in range(n)]


def check_precision(export_dir, placement: Placement, probe) -> float:
    """Max |logits at `placement`'s precision - float32 logits| on a fixed input (`probe(placement)` returns the
    logits of the full-sequence graph run there); a ConfigError above PRECISION_TOLERANCE."""
    if placement.precision == "float32":
        return 0.0
    full = Placement(placement.device, placement.device_id, placement.memory_mb, "float32")
    error = float(np.max(np.abs(np.asarray(probe(placement), dtype="float64") - np.asarray(probe(full)))))
    if not error <= PRECISION_TOLERANCE[placement.precision]:
        raise ConfigError(f"serving.precision={placement.precision}: logits differ from float32 by {error:.3g} on GPU "
                          f"{placement.device_id} (tolerance {PRECISION_TOLERANCE[placement.precision]}); serve this "
                          f"export in float32")
    return error
