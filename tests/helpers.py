"""Shared helpers of the integration tests: run the real CLI in a subprocess against a temporary MLflow store."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import core  # noqa: F401  (zlib before paddle)
from core import REPO_ROOT
from core.processes import free_port  # noqa: F401  (re-exported for the tests)
from core.tracking import metric_history  # noqa: F401  (re-exported for the tests)

TINY_CONFIG = """\
name: t
model: {hidden_size: 64, intermediate_size: 128, num_layers: 4, num_attention_heads: 4, num_key_value_heads: 4,
        max_position_embeddings: 64}
data: {max_documents: 1500, validation_fraction: 0.05}
tokenizer: {min_frequency: 1}
training: {max_steps: 6, seq_length: 32, global_batch_size: 8, logging_interval: 1, eval_interval: 3,
           save_interval: 3, max_eval_batches: 2, warmup_steps: 1}
parallel: {micro_batch_size: 8}
tracking: {experiment: tests}
"""

# (overrides) of each layout with the same global batch of 8 as the single-process run.
LAYOUTS = {
    "single": [],
    "dp2": ["parallel.data=2", "parallel.micro_batch_size=4"],
    "tp2": ["parallel.tensor=2"],
    # (uneven stages: Paddle's stage-boundary list; the even split is exercised by tp2pp2 and pp2v2)
    "pp2": ["parallel.pipeline=2", "parallel.micro_batch_size=4", "parallel.accumulation_steps=2",
            "parallel.stage_layers=[3,1]"],
    "pp2v2": ["parallel.pipeline=2", "parallel.micro_batch_size=2", "parallel.accumulation_steps=4",
              "parallel.schedule=interleaved-1F1B", "parallel.virtual_stages=2"],
    "sharding1x2": ["parallel.sharding_stage=1", "parallel.sharding_degree=2", "parallel.micro_batch_size=4"],
    "tp2pp2": ["parallel.tensor=2", "parallel.pipeline=2", "parallel.micro_batch_size=4",
               "parallel.accumulation_steps=2"],
    "dp2tp2": ["parallel.data=2", "parallel.tensor=2", "parallel.micro_batch_size=4"],
    # parallel.mode=semi_auto: the same degrees, placed by Paddle's auto-parallel API (training/semi_auto.py)
    "tp2-semi": ["parallel.mode=semi_auto", "parallel.tensor=2"],
    "dp2tp2-semi": ["parallel.mode=semi_auto", "parallel.data=2", "parallel.tensor=2", "parallel.micro_batch_size=4"],
    # fused q/k/v and gate/up weights (a weight layout, CPU-capable), loaded from the same unfused initial weights
    "tp2-fused": ["parallel.tensor=2", "performance.fuse_attention_qkv=true", "performance.fuse_attention_ffn=true"],
}


def env_for(store_uri: str) -> dict:
    env = dict(os.environ)
    env["MLFLOW_TRACKING_URI"] = store_uri
    env["PYTHONPATH"] = str(REPO_ROOT)
    env.pop("NODE_RANK", None)
    return env


def cli(args: list[str], store_uri: str, timeout: float = 600, module: str = "pipeline",
        **popen) -> subprocess.CompletedProcess:
    """`python -m pipeline <args>` (or `-m <module>`) as `make` runs it, with its own tracking store."""
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO_ROOT, env=env_for(store_uri),
                          capture_output=True, text=True, timeout=timeout, **popen)


def make_init_weights(config_file: Path, runs_dir: Path, out: Path) -> Path:
    """Seeded random weights of the single-device model, saved once, so every layout starts from the same point."""
    from core.config import load_config
    from training.data.prepare import prepare
    from model.llama import build_model

    import paddle

    config = load_config(config_file, [f"training.runs_dir={runs_dir}"])
    prepared = prepare(config)
    from core.tokenizer import load_tokenizer

    paddle.seed(1)
    model = build_model(config, load_tokenizer(prepared.path / "tokenizer"), 1, 0, pipeline=False)
    model.save_pretrained(str(out / "weights"))
    return out / "weights"


def seeded_world(root: Path) -> dict:
    """A test config, saved initial weights and an MLflow store under `root`: runs of any layout started from it
    see the same weights and batches, so their losses are comparable."""
    config = root / "tiny.yaml"
    config.write_text(TINY_CONFIG)
    weights = make_init_weights(config, root / "runs", root / "init")
    return {"root": root, "config": config, "weights": weights, "runs": root / "runs",
            "uri": f"sqlite:///{root / 'mlflow.db'}"}


def progress_events(run_dir: Path) -> list[dict]:
    """Rank 0's events (training/metrics/progress.py): start, log (step, loss), eval, save, note."""
    import json

    from training.metrics.progress import PROGRESS_FILE

    path = Path(run_dir) / PROGRESS_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(errors="replace").splitlines() if line.endswith("}")]


def wait_for_event(run_dir: Path, condition, proc: subprocess.Popen, what: str, timeout_s: float = 240) -> None:
    """Until some progress event satisfies `condition`; fails if the process ends or `timeout_s` passes first."""
    assert wait_until(lambda: any(condition(e) for e in progress_events(run_dir)), timeout_s, 0.1, alive=proc,
                      context=lambda: f"waiting for {what}"), f"no {what} within {timeout_s:g}s"


def processes_matching(pattern: str, needle: str, env_item: str = "") -> list[int]:
    """Pids whose command line matches `pattern` (pgrep -f) and contains `needle` (and whose environment holds
    `env_item`); a process that ended meanwhile is skipped (other tests start and end processes too)."""
    found = []
    for pid in map(int, subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_text(errors="replace").replace("\0", " ")
            environ = Path(f"/proc/{pid}/environ").read_text(errors="replace") if env_item else ""
        except OSError:
            continue
        if needle in cmdline and env_item in environ:
            found.append(pid)
    return found


def wait_until(condition, timeout_s: float = 5.0, interval_s: float = 0.01, alive=None, context=lambda: "") -> bool:
    """Whether `condition()` became true within timeout_s (polled every interval_s): waits on a state, not a time.
    `alive`: a process that must keep running meanwhile; if it ends first, AssertionError with its exit code and
    `context()` (a log tail, say)."""
    import time

    deadline = time.monotonic() + timeout_s
    while not condition():
        if alive is not None and alive.poll() is not None:
            raise AssertionError(f"the process ended (exit code {alive.returncode}) first; {context()}")
        if time.monotonic() > deadline:
            return False
        time.sleep(interval_s)
    return True


def serving_ports() -> list[str]:
    """Four distinct free ports for a server's http, rpc, api and metrics ports, as overrides."""
    from core.processes import free_ports

    return [f"serving.{key}={port}" for key, port in zip(("http_port", "rpc_port", "api_port", "metrics_port"),
                                                          free_ports(4))]


def make_command(*args: str) -> list[str]:
    """`make -s <args>` as a user types it in the checkout, but never the set-up: the environment's stamp is taken as
    up to date (-o), so a test cannot rebuild .venv whatever the requirements files' times."""
    return ["make", "-s", "-o", f".venv/.installed-{os.environ.get('DEVICE', 'cpu')}", *args]
