"""The generation worker: one process that owns the model's predictors and the continuous-batching scheduler.

    python -m serving.engine.worker --model <export dir> --fd <socket fd> [--threads N] [--max-batch-size N] ...

Started (and restarted, if it dies) by the server process (serving/engine/dispatch.py), which talks to it over a socket:
it sends ("generate", id, prompt, settings, deadline, stream, consumer) / ("cancel", id) / ("stop",) and receives
("ready", info),
("done", id, result), ("error", id, kind, message) and ("state", waiting, running). The worker tokenizes, schedules
(serving/engine/scheduler.py), generates and decodes; it exits when the server's end of the socket closes (the server is gone).
"""
from __future__ import annotations

import argparse
import os
import resource
import time
from multiprocessing.connection import Connection

import numpy as np

import serving  # noqa: F401  (zlib first)
from core import exportdir
from serving.engine import runtime
from serving.engine.scheduler import Job, Scheduler
from serving.engine.prefix_cache import PrefixCache
from serving.protocol import GenerationSettings
from serving.engine.constraints import ConstraintError
from serving.engine.exported import ExportedModel
from serving.protocol import RequestError
from core.processes import die_with_parent
from serving.engine import placement as placements

WARM_UP_PROMPT = "你好"


def full_sequence_session(forward):
    """(prefill, decode) over the full-sequence graph, for exports made before the cache programs existed: the
    "cache" holds the token ids and every step re-runs the whole sequence (slow, exact)."""
    def last_logits(rows):
        return np.stack([np.asarray(forward(np.asarray([row], dtype="int64")))[0, -1] for row in rows])

    def prefill(ids, positions, mask):
        cache = np.where(mask == 1, ids, -1)[None, :, None, :, None]
        return last_logits([r[m == 1].tolist() for r, m in zip(ids, mask)]), cache, cache

    def decode(ids, cache):
        column = ids[None, :, None, :, None]
        cache.append(column, column)
        held, mask = cache.keys, cache.mask
        return last_logits([[int(t) for t, m in zip(held[0, b, 0, :, 0], mask[b]) if m == 1] for b in range(len(ids))])

    return prefill, decode


def build_scheduler(model: ExportedModel, threads: int, generation: str,
                    placement: runtime.Placement = runtime.Placement(), prefix_cache_mb: int = 0,
                    prefix_block_tokens: int = 8, **options) -> Scheduler:
    """The worker's scheduler over the export's cache programs (with prefix caching when prefix_cache_mb > 0 and the
    export has the extend program), or over the full-sequence graph."""
    if generation == "kv_cache" and exportdir.has_cache_programs(model.dir):
        prefill, decode = model.cached_session(threads, placement)
        extend = runtime.extend_session(model.dir, threads, placement) if prefix_cache_mb > 0 else None
    else:  # (an old export, or serving.generation: full)
        predictor = runtime.create_predictor(model.dir, threads=threads, placement=placement)
        prefill, decode = full_sequence_session(lambda ids: runtime.predict(predictor, ids))
        extend = None
    # (the key's scope: this model's weights and version, so that blocks of another model are never hit)
    scope = f"{model.meta['weights_sha256']}:{model.meta['registered_model_name']}:{model.meta['version']}"
    prefix = PrefixCache(prefix_cache_mb * 2**20, prefix_block_tokens, scope) if extend is not None else None
    return Scheduler(prefill, decode, model.eos_id, model.banned_ids, len(model.tokenizer), model.max_length,
                     pad_id=model.tokenizer.pad_token_id, stop_check=lambda job: stop_position(model, job) is not None,
                     extend=extend, prefix_cache=prefix, **options)


def stop_position(model: ExportedModel, job: Job) -> int | None:
    """Where the first of the job's stop strings begins in its text (None: none there yet); kept on the job."""
    if job.stop_at is None and job.settings.stop:
        text = model.decode(job.new)
        found = [i for i in (text.find(s) for s in job.settings.stop) if i >= 0]
        job.stop_at = min(found) if found else None
    return job.stop_at


def answer_text(model: ExportedModel, job: Job) -> str:
    text = model.decode(job.new)
    return text if job.stop_at is None else text[:job.stop_at]


def streamable_text(model: ExportedModel, job: Job) -> str:
    """The part of a running job's text that can be sent: all of it but what could still become a stop string."""
    text = answer_text(model, job)
    hold = max((len(s) for s in job.settings.stop), default=1) - 1 if job.stop_at is None else 0
    return text[:len(text) - hold] if hold else text


def check_precision(model: ExportedModel, placement: runtime.Placement) -> float:
    """A reduced precision's logits against float32 on the same device (serving/engine/placement.py), before serving."""
    probe_ids = np.asarray([model.tokenizer(WARM_UP_PROMPT, add_special_tokens=False)["input_ids"]], dtype="int64")
    return placements.check_precision(model.dir, placement,
                                      lambda where: runtime.predict(runtime.create_predictor(model.dir, placement=where),
                                                                    probe_ids))


class Worker:
    def __init__(self, conn: Connection, model: ExportedModel, scheduler: Scheduler):
        self.conn, self.model, self.scheduler = conn, model, scheduler
        self.state = (0, 0)
        self.evictions_sent = 0  # (the prefix cache's evictions already reported)

    def send(self, *message) -> None:
        self.conn.send(message)

    def receive(self, wait: bool) -> list:
        """The server's messages that have arrived (waiting for one when `wait`). Its end closing means the server
        is gone: so is this worker. (Read in the loop itself, not by a thread: one hand-over less per request.)"""
        messages = []
        try:
            if wait:
                self.conn.poll(None)
            while self.conn.poll(0):
                messages.append(self.conn.recv())
        except (EOFError, OSError):
            os._exit(0)
        return messages

    def warm_up(self) -> float:
        """A tiny generation through the whole path: the worker is ready only if it succeeds."""
        t0 = time.monotonic()
        self.scheduler.add(Job(-1, self.model.encode(WARM_UP_PROMPT), GenerationSettings(max_new_tokens=2)))
        while not self.scheduler.idle:
            self.scheduler.step()
        return time.monotonic() - t0

    def run(self) -> None:
        while True:
            for message in self.receive(wait=self.scheduler.idle):  # (idle: wait for work; busy: go on decoding)
                if message[0] == "stop":
                    return
                self.handle(message)
            if not self.scheduler.idle:
                outcomes = self.scheduler.step()
                self.stream([job for job in self.scheduler.running if job.stream])
                for outcome in outcomes:
                    self.report(outcome)
            state = (len(self.scheduler.waiting), len(self.scheduler.running))
            if state != self.state:
                self.state = state
                self.send("state", *state)

    def handle(self, message) -> None:
        if message[0] == "cancel":
            self.scheduler.cancel(message[1])
            return
        _, job_id, prompt, settings, deadline, stream, consumer = message
        try:
            ids = self.model.encode(prompt)
            constraint = self.model.constraint(settings)
        except (RequestError, ConstraintError) as exc:
            self.send("error", job_id, "bad_request", str(exc))
            return
        self.scheduler.add(Job(job_id, ids, settings, deadline=deadline, stream=stream, constraint=constraint,
                               consumer=consumer))

    def stream(self, jobs: list[Job]) -> None:
        """Send each streaming job's new text since the last step (the server forwards it as it comes), with the
        logprobs of the tokens generated since the last delta when asked (joined: the unstreamed answer's). One
        message for the step's deltas: a message per job cost ~10% of a worker's time at 16 streams (its write)."""
        deltas = []
        for job in jobs:
            text = streamable_text(self.model, job)
            if len(text) > job.streamed:
                lp = logprobs(self.model, job, job.streamed_logprobs) if job.settings.logprobs >= 0 else None
                deltas.append((job.id, {"text": text[job.streamed:], "logprobs": lp}))
                job.streamed, job.streamed_logprobs = len(text), len(job.new)
        if deltas:
            self.send("deltas", deltas)

    def report(self, outcome) -> None:
        job = outcome.job
        if outcome.status == "deadline":
            self.send("error", job.id, "deadline", "the request waited past its deadline before generation began")
        elif outcome.status == "done":
            self.send("done", job.id, {**job_result(self.model, job), "prefix_cache": self.prefix_counts()})
        elif outcome.status == "error":  # (its constraint could not go on: this request ends, the batch goes on)
            self.send("error", job.id, "bad_request", f"generation stopped after {len(job.new)} tokens: {job.error}")
        # (cancelled: the server already answered the client)


    def prefix_counts(self) -> dict:
        """The prefix cache's evictions since the last answer, and the blocks and bytes it holds (the server's
        counters and gauges: serving/server/metrics.py)."""
        prefix = self.scheduler.prefix
        if prefix is None:
            return {}
        evicted, self.evictions_sent = prefix.evictions - self.evictions_sent, prefix.evictions
        return {"evictions": evicted, "blocks": len(prefix), "bytes": prefix.bytes}


def job_result(model: ExportedModel, job: Job) -> dict:
    """A finished job as every entrypoint receives it: text (stop strings cut), token ids, finish reason, timings."""
    stopped = job.stop_at is not None or bool(job.new and job.new[-1] == model.eos_id)
    return {"token_ids": job.new, "text": answer_text(model, job), "prompt_tokens": len(job.prompt_ids),
            "cached_tokens": job.cached,
            "prompt_token_ids": job.prompt_ids, "batch_size": max(1, job.peak_batch), "received": job.received,
            "first_token_at": job.first_token_at, "finished_at": time.monotonic(),
            "finish_reason": "stop" if stopped else "length", "streamed": job.streamed,
            "streamed_logprobs": job.streamed_logprobs,
            **({"logprobs": logprobs(model, job)} if job.settings.logprobs >= 0 else {})}


def logprobs(model: ExportedModel, job: Job, start: int = 0) -> dict:
    """OpenAI's completion logprobs: each new token's text, log-probability and top alternatives (as text), from
    new token `start` on."""
    piece = lambda i: model.decode([i]) if i != model.eos_id else ""  # noqa: E731
    kept = job.logprobs[start:len(job.new)]
    return {"tokens": [piece(e["token"]) for e in kept], "token_logprobs": [e["logprob"] for e in kept],
            "top_logprobs": [{piece(i): lp for i, lp in e["top"]} for e in kept]}


def generate_all(model: ExportedModel, scheduler: Scheduler, requests: list[tuple[str, GenerationSettings]]) -> list:
    """In this process, to completion: each request's result, or its RequestError (a prompt the model refuses, a
    grammar that does not compile or cannot go on)."""
    results: list = [None] * len(requests)
    for i, (prompt, settings) in enumerate(requests):
        try:
            scheduler.add(Job(i, model.encode(prompt), settings, constraint=model.constraint(settings)))
        except (RequestError, ConstraintError) as exc:
            results[i] = exc if isinstance(exc, RequestError) else RequestError("bad_request", str(exc))
    while not scheduler.idle:
        for outcome in scheduler.step():
            job = outcome.job
            results[job.id] = (RequestError("bad_request", job.error) if outcome.status == "error"
                               else job_result(model, job))
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--fd", type=int, required=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--generation", default="kv_cache")
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--max-batch-tokens", type=int, default=0)
    p.add_argument("--policy", default="continuous")
    p.add_argument("--mask-thread", action="store_true")
    p.add_argument("--prefix-cache-mb", type=int, default=0)
    p.add_argument("--prefix-block-tokens", type=int, default=8)
    p.add_argument("--device", default="cpu", choices=("cpu", "gpu"))
    p.add_argument("--device-id", type=int, default=0)
    p.add_argument("--gpu-memory-mb", type=int, default=1024)
    p.add_argument("--precision", default="float32", choices=("float32", "float16", "bfloat16"))
    args = p.parse_args()
    placement = runtime.Placement(args.device, args.device_id, args.gpu_memory_mb, args.precision)

    die_with_parent()
    from core.workarounds import heap

    heap.keep_freed_blocks()  # (before the model loads: its per-step arrays reuse freed blocks)
    conn = Connection(args.fd)
    t0 = time.monotonic()
    model = ExportedModel(args.model)
    precision_error = check_precision(model, placement)
    scheduler = build_scheduler(model, args.threads, args.generation, placement, max_batch_size=args.max_batch_size,
                                max_batch_tokens=args.max_batch_tokens, policy=args.policy,
                                overlap_masks=args.mask_thread, prefix_cache_mb=args.prefix_cache_mb,
                                prefix_block_tokens=args.prefix_block_tokens)
    worker = Worker(conn, model, scheduler)
    warm_s = worker.warm_up()
    worker.send("ready", {"pid": os.getpid(), "load_s": round(time.monotonic() - t0, 2), "warm_up_s": round(warm_s, 3),
                          "placement": placement.describe(), "precision_error": precision_error,
                          "rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)})
    worker.run()


if __name__ == "__main__":
    main()
