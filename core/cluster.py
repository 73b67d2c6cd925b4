"""Ray, the one way this project reaches past one machine's processes (`make data` and `make generate` with the ray
engine): a local instance of `workers` CPUs, or the cluster at `address` (`ray://...` / `auto`). Every Ray worker
imports this repository (PYTHONPATH) and runs one thread of tokenizer or math code per CPU it was given."""
from __future__ import annotations

import os

from core import REPO_ROOT
from core.errors import ConfigError

# Ray Data 2.60 refuses pyarrow < 17 at its first Dataset; PaddleNLP 2.8.1 needs pyarrow 16.1.0 (its `datasets` pin
# fails to import on 17: docs/platform-notes.md). What this project uses of Ray Data (from_items, map_batches over
# actors, iter_batches of numpy) works on 16.1.0 -- tests/integration/test_generate.py checks the rows -- so the
# version check is switched off, in this process and in Ray's workers.
PYARROW_CHECK = {"RAY_DISABLE_PYARROW_VERSION_CHECK": "1"}


def init_ray(address: str, workers: int):
    """The ray module, initialised once per process."""
    try:
        import ray
    except ImportError:
        raise ConfigError("the ray engine needs the ray package (pip install ray)") from None
    os.environ.update(PYARROW_CHECK)
    if not ray.is_initialized():
        env = {"env_vars": {"PYTHONPATH": str(REPO_ROOT), "RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                            **PYARROW_CHECK}}
        ray.init(address=address or None, num_cpus=workers if not address else None, include_dashboard=False,
                 log_to_driver=False, runtime_env=env, logging_level="ERROR", configure_logging=True)
    return ray
