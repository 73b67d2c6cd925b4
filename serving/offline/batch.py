"""Generation over a table (`make generate`): every row of a JSON-lines or Parquet file through the continuous-batching
engine, written to a JSON-lines (or Parquet) table as rows finish.

    input row    `prompt` and, per row, the serving protocol's settings (serving/protocol.py): max_new_tokens,
                 temperature, top_k, top_p, seed, stop, logprobs; `id` (default: the row's number). Other columns
                 are not read.
    output row   id, text, token_ids, finish_reason, prompt_tokens, lineage (the model version), logprobs when
                 asked; a row the protocol refuses gets `error` instead (the job goes on)

Two engines, the same rows: `local` runs the server's own workers (serving/engine/dispatch.py: one process per core,
each a continuous-batching scheduler, rows fed as slots free up); `ray` maps batches of rows over Ray Data actors,
each loading the model once and running the same scheduler in process (serving/engine/worker.py generate_all).
Greedy and seeded rows do not depend on their batch (serving/engine/generation.py), so both write the same rows.

Resumable: each finished row is one line, appended and flushed whole; a rerun reads the rows already written
(dropping a line cut short by a kill), and generates only the others, so after kill -9 every row appears exactly
once. A Parquet output is written as `<output>.partial.jsonl` and converted when every row is done.
"""
from __future__ import annotations

import json
import os
import queue
import sys
import time
from dataclasses import replace
from pathlib import Path

from core.errors import ConfigError, json_object
from core.files import atomic_write
from serving.engine.exported import lineage as lineage_of
from serving.protocol import Limits, RequestError, parse
from core.cluster import init_ray
from serving.engine.dispatch import Dispatcher, per_worker_capacity
from serving.engine.exported import ExportedModel
from serving.engine.worker import build_scheduler, generate_all

ROW_SETTINGS = ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop", "logprobs")
FORMATS = (".jsonl", ".parquet")


# -- tables -------------------------------------------------------------------------------------------------------------
def read_table(path: Path) -> list[dict]:
    """The input rows, each with an `id` (unique; default its row number)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"INPUT={path}: no such file")
    if path.suffix == ".parquet":
        import pandas as pd

        rows = [{k: _plain(v) for k, v in r.items()} for r in pd.read_parquet(path).to_dict("records")]
    elif path.suffix in (".jsonl", ".json"):
        rows = []
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            rows.append(json_object(line, f"INPUT={path}, line {number}", "a JSON object with a `prompt`"))
    else:
        raise ConfigError(f"INPUT={path}: expected a .jsonl or .parquet file")
    seen = set()
    for number, row in enumerate(rows):
        row.setdefault("id", number)
        key = row_key(row["id"])
        if key in seen:
            raise ConfigError(f"INPUT={path}: id {row['id']!r} appears more than once")
        seen.add(key)
    return rows


def _plain(value):
    """numpy scalars and arrays (pandas) -> Python values; missing (NaN / None) -> None."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    try:
        return None if value is None or value != value else value
    except (TypeError, ValueError):
        return value


def row_key(ident) -> str:
    return json.dumps(ident, sort_keys=True, ensure_ascii=False)


def request_of(row: dict, limits: Limits):
    """A row -> its protocol Request (RequestError when the protocol refuses it)."""
    values = {k: row.get(k) for k in ("prompt", *ROW_SETTINGS) if row.get(k) is not None}
    return parse(values, limits)


class Output:
    """The output table, append-only while the job runs (see the module docstring)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        if self.path.suffix not in FORMATS:
            raise ConfigError(f"OUTPUT={self.path}: expected a .jsonl or .parquet file")
        self.lines = self.path.with_name(self.path.name + ".partial.jsonl") if self.path.suffix == ".parquet" \
            else self.path
        self.done = self._recover()
        self.lines.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.lines, "a", encoding="utf-8")
        self.last_sync = time.monotonic()

    def _recover(self) -> set[str]:
        """The ids already written; a last line cut short by a kill is cut off."""
        if self.path.suffix == ".parquet" and self.path.exists() and not self.lines.exists():
            import pandas as pd

            return {row_key(_plain(i)) for i in pd.read_parquet(self.path, columns=["id"])["id"]}
        if not self.lines.exists():
            return set()
        data = self.lines.read_bytes()
        complete = data[:data.rfind(b"\n") + 1]
        if len(complete) != len(data):
            with open(self.lines, "r+b") as f:
                f.truncate(len(complete))
        return {row_key(json.loads(line)["id"]) for line in complete.decode("utf-8").splitlines() if line.strip()}

    def write(self, row: dict) -> None:
        self.file.write(json.dumps(row, ensure_ascii=False) + "\n")  # (one line, one write: whole or cut off)
        self.file.flush()
        self.done.add(row_key(row["id"]))
        if time.monotonic() - self.last_sync > 5:
            os.fsync(self.file.fileno())
            self.last_sync = time.monotonic()

    def close(self) -> None:
        os.fsync(self.file.fileno())
        self.file.close()
        if self.path.suffix == ".parquet" and self.lines.exists():
            import pandas as pd

            rows = [json.loads(line) for line in self.lines.read_text(encoding="utf-8").splitlines() if line.strip()]
            frame = pd.DataFrame(rows)
            atomic_write(self.path, frame.to_parquet(index=False))
            self.lines.unlink()


def output_row(ident, result: dict | None, error: RequestError | None = None, lineage: dict | None = None) -> dict:
    if error is not None:
        return {"id": ident, "error": error.message}
    row = {"id": ident, "text": result["text"], "token_ids": result["token_ids"],
           "finish_reason": result["finish_reason"], "prompt_tokens": result["prompt_tokens"],
           "lineage": result.get("lineage", lineage)}
    if "logprobs" in result:
        row["logprobs"] = result["logprobs"]
    return row


# -- engines ------------------------------------------------------------------------------------------------------------
def run_local(model_dir: Path, rows: list[dict], serving_config, limits: Limits, workers: int, threads: int,
              write, attempts: int = 3, on_ready=None) -> None:
    """Rows through the server's own workers, at most their capacity in flight; a row whose worker died is sent
    again (up to `attempts` times)."""
    # (offline: batches of serving.generate_batch_size, sized for throughput; the server's max_batch_size is a latency
    # setting; max_batch_tokens 0 = that many sequences at the model's full length)
    s = replace(serving_config, request_timeout_s=24 * 3600.0, max_batch_size=serving_config.generate_batch_size,
                max_batch_tokens=0, max_queue=serving_config.generate_batch_size)
    dispatcher = Dispatcher(s, model_dir, threads, workers, log=lambda text: print(text, file=sys.stderr, flush=True))
    dispatcher.start()
    try:
        _wait_ready(dispatcher)
        if on_ready:
            on_ready()
        window = per_worker_capacity(s, workers) * workers
        finished: queue.Queue = queue.Queue()
        todo, in_flight, tries = list(reversed(rows)), 0, {}
        while todo or in_flight:
            while todo and in_flight < window:
                row = todo.pop()
                try:
                    request = request_of(row, limits)
                except RequestError as exc:
                    write(output_row(row["id"], None, exc))
                    continue
                dispatcher.submit(request.prompt, request.settings, s.request_timeout_s,
                                  on_event=lambda event, row=row: event[0] != "delta" and finished.put((row, event)))
                in_flight += 1
            row, (kind, value) = finished.get()
            in_flight -= 1
            if kind == "done":
                write(output_row(row["id"], value))
            elif value.kind == "worker_died" and tries.get(row_key(row["id"]), 1) < attempts:
                tries[row_key(row["id"])] = tries.get(row_key(row["id"]), 1) + 1
                todo.append(row)
            else:
                write(output_row(row["id"], None, value))
    finally:
        dispatcher.stop()


def _wait_ready(dispatcher, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(w.ready.is_set() for w in dispatcher.workers):
        if dispatcher.fatal or time.monotonic() > deadline:
            raise ConfigError(f"the generation workers did not start: {dispatcher.fatal or 'timeout'}")
        time.sleep(0.05)


class RayGenerator:
    """A Ray Data actor: the model loaded once, each batch of rows generated to completion by the scheduler."""

    def __init__(self, model_dir: str, generation: str, max_batch_size: int, limits: Limits):
        self.model = ExportedModel(model_dir)
        self.scheduler = build_scheduler(self.model, 1, generation, max_batch_size=max_batch_size)
        self.limits, self.lineage = limits, lineage_of(self.model.meta)

    def __call__(self, batch: dict) -> dict:
        rows = [json.loads(r) for r in batch["row"]]
        out, requests, index = [None] * len(rows), [], []
        for i, row in enumerate(rows):
            try:
                request = request_of(row, self.limits)
            except RequestError as exc:
                out[i] = output_row(row["id"], None, exc)
                continue
            requests.append((request.prompt, request.settings))
            index.append(i)
        for i, result in zip(index, generate_all(self.model, self.scheduler, requests)):
            out[i] = output_row(rows[i]["id"], None, result) if isinstance(result, RequestError) else \
                output_row(rows[i]["id"], result, lineage=self.lineage)
        return {"row": [json.dumps(r, ensure_ascii=False) for r in out]}


def run_ray(model_dir: Path, rows: list[dict], serving_config, limits: Limits, workers: int, address: str,
            write) -> None:
    """Rows over Ray Data: `workers` actors of one CPU each, batches of serving.generate_batch_size rows."""
    if not rows:
        return
    ray = init_ray(address, workers)
    dataset = ray.data.from_items([{"row": json.dumps(r, ensure_ascii=False)} for r in rows])
    generated = dataset.map_batches(
        RayGenerator, fn_constructor_args=(str(model_dir), serving_config.generation,
                                           serving_config.generate_batch_size, limits),
        batch_size=serving_config.generate_batch_size, concurrency=workers, num_cpus=1)
    for batch in generated.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=workers):
        for line in batch["row"]:
            write(json.loads(line))
