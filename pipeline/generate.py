"""`make generate MODEL=... INPUT=prompts.jsonl|.parquet OUTPUT=generations.jsonl|.parquet [ENGINE=local|ray]`:
batch generation over a table with the serving engine (serving/offline/batch.py), resumable after a kill.

MODEL is what `make serve` takes (an export directory, models:/<name>/<version>, @<alias> or /latest). Per-row
settings and limits are the serving protocol's, with `serving.max_new_tokens_limit` and
`serving.default_max_new_tokens` from the config; prompts are limited only by the model's context. Workers: as many
as the server's (`serving.workers`: 0 = one per core; `--workers` overrides), each batching up to
`serving.generate_batch_size` rows (256: offline batches are sized for throughput, not the server's latency). On Spark, the same model is `mlflow.pyfunc.spark_udf(spark,
"models:/<name>/<version>")` over the registered version (docs/serving.md).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from core import registry
from core.config import Config, ConfigError
from training.launch.console import duration
from pipeline.runner.cli import config_argument, overrides_argument
from serving.engine.placement import worker_count
from serving.offline import batch
from serving.protocol import Limits

HELP = "batch generation over a table (jsonl/parquet), resumable"


def arguments(p) -> None:
    config_argument(p)
    p.add_argument("--model", default="", help="as for serve (default: the newest registered version)")
    p.add_argument("--input", default="", help="prompts: .jsonl or .parquet with `prompt` (and `id`, settings)")
    p.add_argument("--output", default="", help=".jsonl or .parquet; rows already there are not generated again")
    p.add_argument("--engine", default="local", help="local (one worker process per core) or ray (Ray Data)")
    p.add_argument("--workers", type=int, default=0, help="worker processes / Ray actors (0 = one per core)")
    p.add_argument("--ray-address", default="", help="a Ray cluster (default: a local instance)")
    overrides_argument(p)


def run(config: Config, model: str, input_path: str, output_path: str, engine: str = "local", workers: int = 0,
        ray_address: str = "") -> dict:
    if not input_path or not output_path:
        raise ConfigError("make generate needs INPUT=<prompts .jsonl/.parquet> and OUTPUT=<.jsonl/.parquet>")
    if engine not in ("local", "ray"):
        raise ConfigError(f"ENGINE={engine}: expected local or ray")
    rows = batch.read_table(Path(input_path))
    output = batch.Output(Path(output_path))  # (checks the format before the model loads)
    model_dir = registry.resolve(config, model)
    s = config.serving
    limits = Limits(max_prompt_chars=1 << 24, max_new_tokens_limit=s.max_new_tokens_limit,
                    default_max_new_tokens=s.default_max_new_tokens, max_request_bytes=1 << 30)
    todo = [r for r in rows if batch.row_key(r["id"]) not in output.done]
    workers = workers or worker_count(config.serving)  # (as the server: serving.workers, else one per core)
    print(f"generate: {len(rows):,} rows in {input_path}, {len(rows) - len(todo):,} already in {output_path}; "
          f"{len(todo):,} to generate with {model_dir} on {workers} {engine} worker(s)", flush=True)
    progress = Progress(len(todo))

    def write(row: dict) -> None:
        output.write(row)
        progress.step(row)

    try:
        if not todo:
            pass  # (nothing left: no workers to start)
        elif engine == "ray":
            batch.run_ray(model_dir, todo, s, limits, workers, ray_address, write)
        else:
            batch.run_local(model_dir, todo, s, limits, workers, 1, write, on_ready=progress.restart)
    finally:
        output.close()
    summary = {**progress.summary(), "skipped": len(rows) - len(todo), "output": str(output_path), "engine": engine}
    print("generate: done " + json.dumps(summary), flush=True)
    return summary


class Progress:
    """One line every few seconds: rows done, rows/s, tokens/s, ETA."""

    def __init__(self, total: int, log=None, every_s: float = 2.0):
        self.total, self.done, self.tokens, self.every_s = total, 0, 0, every_s
        self.log = log or (lambda text: print(text, file=sys.stderr, flush=True))
        self.began = self.last = time.monotonic()

    def restart(self) -> None:
        """Count from now (the model has loaded)."""
        self.began = self.last = time.monotonic()

    def step(self, row: dict) -> None:
        self.done += 1
        self.tokens += len(row.get("token_ids", ()))
        now = time.monotonic()
        if now - self.last >= self.every_s or self.done == self.total:
            self.last = now
            self.log(self.line(now))

    def line(self, now: float) -> str:
        elapsed = max(now - self.began, 1e-9)
        rate = self.done / elapsed
        eta_text = duration((self.total - self.done) / rate) if rate else "?"
        return (f"generate: {self.done:,}/{self.total:,} rows ({100 * self.done / max(self.total, 1):.1f}%), "
                f"{rate:.1f} rows/s, {self.tokens / elapsed:,.0f} tokens/s, ETA {eta_text}")

    def summary(self) -> dict:
        elapsed = max(time.monotonic() - self.began, 1e-9)
        return {"rows": self.done, "tokens": self.tokens, "seconds": round(elapsed, 3),
                "tokens_per_s": round(self.tokens / elapsed, 1)}


def main(config: Config, args) -> int:
    run(config, args.model, args.input, args.output, args.engine, args.workers, args.ray_address)
    return 0
