"""Continuous batching over the key/value-cache programs: requests join the running batch between decode steps.

The Scheduler is pure logic around two functions (the exported prefill and decode programs, or any functions with
their signatures: serving/engine/generation.py), so it is tested with a hand-made model. Each `step()`:

1. drops waiting requests whose deadline passed and cancelled ones;
2. admits waiting requests while the batch has room (`max_batch_size` sequences, `max_batch_tokens` cache
   positions); with `policy="static"` only when nothing is running (batches formed once, for comparison);
3. prefills the admitted requests together (left-padded, masked), picks their first tokens and merges their caches
   into the running batch (the narrower cache is left-padded with masked positions); with a prefix cache
   (serving/engine/prefix_cache.py) and an extend program, the prompts' cached prefixes are looked up first and,
   when any is found, only the rest of each prompt runs (extend, over the found keys and values); the prompts'
   whole blocks are cached after the prefill, and a finished request's prompt + answer (a conversation's next turn
   starts with them);
4. runs one decode step for the whole running batch; finished requests (end token, max_new_tokens, the model's
   maximum length) leave the batch at once, and columns no running sequence needs any more are trimmed.

Every sequence keeps its own positions, attention mask and seeded sampler, so its tokens do not depend on what it was
batched with or when it joined (tests/unit/test_engine.py; served: tests/integration/test_serving.py).
"""
from __future__ import annotations

import math

import time
from collections import deque
from dataclasses import dataclass, field
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from serving.protocol import GenerationSettings
from serving.engine.generation import budget, choose_rows, token_logprobs
from serving.engine.constraints import NOTHING_ALLOWED, ConstraintError, allowed_rows
from serving.engine.kv_cache import DecodeCache


@dataclass
class Job:
    id: int
    prompt_ids: list[int]
    settings: GenerationSettings
    deadline: float = float("inf")  # time.monotonic() after which it is refused / given up
    received: float = field(default_factory=time.monotonic)
    new: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    peak_batch: int = 0  # the largest batch it was decoded in
    budget: int = 0
    rng: object = None
    pending: int | None = None  # the token chosen last, fed to the next decode step
    logprobs: list = field(default_factory=list)  # (settings.logprobs >= 0) one entry per new token
    stream: bool = False  # the worker sends its text as it grows
    streamed: int = 0  # characters of its text already sent
    streamed_logprobs: int = 0  # (stream with logprobs) tokens whose logprobs were already sent
    stop_at: int | None = None  # where a stop string begins in its text (finished by it)
    constraint: object = None  # (settings.grammar) its matcher: serving/engine/constraints.py Constraint
    error: str = ""  # why it ended without an answer (its constraint could not go on)
    consumer: str = ""  # who sent it (the gateway's consumer): part of its prefix-cache key
    cached: int = 0  # prompt tokens found in the prefix cache (not computed)
    chain: list = field(default_factory=list)  # (prefix caching) its tokens' block keys, hashed once


@dataclass
class Outcome:
    job: Job
    status: str  # "done" | "deadline" | "cancelled" | "error" (job.error says why)


class Scheduler:
    def __init__(self, prefill, decode, eos_id: int, banned_ids: list[int], usable_vocab: int, max_length: int,
                 pad_id: int = 0, max_batch_size: int = 16, max_batch_tokens: int = 0, policy: str = "continuous",
                 stop_check=None, overlap_masks: bool = False, extend=None, prefix_cache=None):
        self.prefill, self.decode = prefill, decode
        # (prefix caching: both, or neither) extend: runtime.extend_session's function; prefix_cache: PrefixCache
        both = extend is not None and prefix_cache is not None
        self.extend, self.prefix = (extend, prefix_cache) if both else (None, None)
        # (constrained rows) overlap_masks: the next step's masks are filled on a thread while the decode program
        # runs, llguidance releasing the GIL (serving.mask_thread); False = filled in the choose step
        self.overlap_masks, self._ahead, self._pool = overlap_masks, None, None
        self.stop_check = stop_check  # job -> True when its text reached one of its stop strings (the worker's)
        self.eos_id, self.banned_ids, self.usable_vocab = eos_id, banned_ids, usable_vocab
        self.max_length, self.pad_id, self.policy = max_length, pad_id, policy
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens or max_batch_size * max_length
        self.waiting: deque[Job] = deque()
        self.running: list[Job] = []
        self.cancelled: set[int] = set()
        self.earliest_deadline = math.inf  # (of the waiting jobs, or earlier: the queue is scanned only from then)
        self.cache: DecodeCache | None = None  # the running batch's keys and values (serving/engine/kv_cache.py)

    # -- the queue ------------------------------------------------------------------------------------------------
    def add(self, job: Job) -> None:
        job.budget = budget(len(job.prompt_ids), job.settings, self.max_length)
        job.rng = np.random.default_rng(job.settings.seed)
        self.waiting.append(job)
        self.earliest_deadline = min(self.earliest_deadline, job.deadline)

    def cancel(self, job_id: int) -> None:
        self.cancelled.add(job_id)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    # -- one iteration ----------------------------------------------------------------------------------------------
    def step(self, now: float | None = None) -> list[Outcome]:
        now = time.monotonic() if now is None else now
        out = self._drop_waiting(now) + self._drop_running()
        admitted = self._admit()
        if admitted:
            out += self._prefill(admitted, now)
        if self.running:
            out += self._decode_step()
        self._fill_ahead()
        return out

    def _fill_ahead(self) -> None:
        """Start filling the running constrained jobs' next masks (taken by the next decode step's choose)."""
        jobs = [job for job in self.running if job.constraint is not None]
        if not self.overlap_masks or not jobs:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="masks")
        self._ahead = ({job.id for job in jobs}, self._pool.submit(self._masks, jobs))

    def _drop_waiting(self, now: float) -> list[Outcome]:
        if not self.cancelled and now < self.earliest_deadline:
            return []  # (nothing to drop: no pass over a long queue at every step)
        out, keep = [], deque()
        for job in self.waiting:
            if job.id in self.cancelled:
                self.cancelled.discard(job.id)
                out.append(Outcome(job, "cancelled"))
            elif job.deadline <= now:
                out.append(Outcome(job, "deadline"))
            else:
                keep.append(job)
        self.waiting = keep
        self.earliest_deadline = min((job.deadline for job in keep), default=math.inf)
        return out

    def _drop_running(self) -> list[Outcome]:
        gone = [r for r, job in enumerate(self.running) if job.id in self.cancelled]
        if not gone:
            return []
        out = [Outcome(self.running[r], "cancelled") for r in gone]
        self.cancelled -= {self.running[r].id for r in gone}
        self._keep([r for r in range(len(self.running)) if r not in gone])
        return out

    def _admit(self) -> list[Job]:
        if self.policy == "static" and self.running:
            return []
        admitted: list[Job] = []
        width = self.cache.used if self.running else 0
        while self.waiting and len(self.running) + len(admitted) < self.max_batch_size:
            job = self.waiting[0]
            rows = len(self.running) + len(admitted) + 1
            if admitted and rows * max(width, len(job.prompt_ids)) > self.max_batch_tokens:
                break
            admitted.append(self.waiting.popleft())
            width = max(width, len(job.prompt_ids))
        return admitted

    def _prefill(self, jobs: list[Job], now: float) -> list[Outcome]:
        out = [Outcome(job, "done") for job in jobs if job.budget <= 0]  # (a prompt at the model's maximum length)
        jobs = [job for job in jobs if job.budget > 0]
        if not jobs:
            return out
        found = [(0, None, None)] * len(jobs)
        if self.prefix is not None:  # (not its truth: an empty cache has length 0)
            for job in jobs:
                job.chain = self.prefix.chain(job.prompt_ids, job.consumer)
            found = [self.prefix.lookup(job.prompt_ids, job.chain) for job in jobs]
        if any(n for n, _, _ in found):
            logits, keys, values, mask = self._extend(jobs, found)
        else:
            ids, positions, mask = self._left_padded([job.prompt_ids for job in jobs], [0] * len(jobs))
            logits, keys, values = self.prefill(ids, positions, mask)
        joining = DecodeCache(keys, values, mask, np.array([len(job.prompt_ids) for job in jobs], dtype="int64"))
        for r, job in enumerate(jobs):
            job.cached = found[r][0]
            self._remember(job, joining, r, job.prompt_ids)
        joined = time.monotonic()
        for job in jobs:
            job.first_token_at, job.peak_batch = joined, max(job.peak_batch, len(jobs))
        self._choose(jobs, logits)
        self._merge(jobs, joining)
        return out + self._finish_done()

    def _left_padded(self, rows: list[list[int]], starts: list[int]):
        """(ids, positions, mask) of token rows left-padded to one width, row r's positions from starts[r]."""
        width = max(map(len, rows))
        ids = np.full((len(rows), width), self.pad_id, dtype="int64")
        mask = np.zeros((len(rows), width), dtype="float32")
        positions = np.zeros((len(rows), width), dtype="int64")
        for r, (row, start) in enumerate(zip(rows, starts)):
            n = len(row)
            ids[r, width - n:], mask[r, width - n:] = row, 1.0
            positions[r, width - n:] = np.arange(start, start + n)
        return ids, positions, mask

    def _extend(self, jobs: list[Job], found: list[tuple]):
        """The prompts' uncached tokens over their cached prefixes (each part left-padded, rows without one over
        masked columns): (logits, keys, values, mask) of the whole prompts, as a prefill returns them."""
        sample = next(k for n, k, _ in found if n)
        past_width = max(n for n, _, _ in found)
        shape = (sample.shape[0], len(jobs), sample.shape[1], past_width, sample.shape[3])
        past_keys, past_values = np.zeros(shape, "float32"), np.zeros(shape, "float32")
        past_mask = np.zeros((len(jobs), past_width), "float32")
        for r, (n, k, v) in enumerate(found):
            if n:
                past_keys[:, r, :, past_width - n:], past_values[:, r, :, past_width - n:] = k, v
                past_mask[r, past_width - n:] = 1.0
        ids, positions, mask = self._left_padded([job.prompt_ids[n:] for job, (n, _, _) in zip(jobs, found)],
                                                 [n for n, _, _ in found])
        mask = np.concatenate([past_mask, mask], axis=1)
        logits, keys, values = self.extend(ids, positions, mask, past_keys, past_values)
        return (logits, np.concatenate([past_keys, keys], axis=3), np.concatenate([past_values, values], axis=3),
                mask)

    def _remember(self, job: Job, cache: DecodeCache, row: int, ids: list[int]) -> None:
        """Cache the whole blocks of `ids`, the tokens whose keys and values the cache's `row` holds."""
        if self.prefix is None or len(ids) < self.prefix.block:
            return
        columns = np.flatnonzero(cache.mask[row])
        if len(columns) != len(ids):  # (not the tokens this row holds: nothing cached rather than wrong keys)
            return
        keys, values, b = cache.keys[:, row], cache.values[:, row], self.prefix.block
        job.chain = self.prefix.chain(ids, job.consumer, known=job.chain)
        self.prefix.insert(job.chain, lambda first, stop: (keys[:, :, columns[first * b:stop * b]],
                                                           values[:, :, columns[first * b:stop * b]]))

    def _decode_step(self) -> list[Outcome]:
        for job in self.running:
            job.peak_batch = max(job.peak_batch, len(self.running))
        tokens = np.asarray([job.pending for job in self.running], dtype="int64")[:, None]
        logits = self.decode(tokens, self.cache)  # (the step's keys and values written into the cache's next column)
        self._choose(self.running, logits)
        return self._finish_done()

    # -- helpers ------------------------------------------------------------------------------------------------------
    def _choose(self, jobs: list[Job], logits) -> None:
        allowed = self._allowed(jobs)
        tokens = choose_rows(logits, [job.settings for job in jobs], [job.rng for job in jobs], self.banned_ids,
                             self.usable_vocab, allowed)
        for r, (job, token) in enumerate(zip(jobs, tokens)):
            if job.error:
                continue
            job.new.append(token)
            job.pending = token
            if job.settings.logprobs >= 0:
                job.logprobs.append(token_logprobs(logits[r], token, job.settings.logprobs, self.banned_ids,
                                                   self.usable_vocab))
            if job.constraint is not None:
                try:
                    job.constraint.advance(token)
                except ConstraintError as exc:
                    job.error = str(exc)

    def _allowed(self, jobs: list[Job]) -> dict:
        """{row: allowed tokens} of the constrained jobs (banned ids never), filled ahead when they were; a job
        whose constraint allows nothing gets its error (it ends at this step, the others go on)."""
        constrained = [job for job in jobs if job.constraint is not None]
        if not constrained:
            return {}
        ready = {}
        if self._ahead is not None and self._ahead[0] & {job.id for job in constrained}:
            ready, self._ahead = self._ahead[1].result(), None
        missing = [job for job in constrained if job.id not in ready]
        ready.update(self._masks(missing) if missing else {})
        out = {}
        for r, job in enumerate(jobs):
            if job.constraint is not None:
                mask, why = ready[job.id]
                if why:
                    job.error = why
                else:
                    out[r] = mask
        return out

    def _masks(self, jobs: list[Job]) -> dict:
        """{job id: (allowed tokens, "") or (None, why it cannot go on)}."""
        allowed, failed = allowed_rows([job.constraint for job in jobs], self.usable_vocab)
        allowed[:, [i for i in self.banned_ids if i < self.usable_vocab]] = False
        return {job.id: (None, failed[k]) if k in failed else (allowed[k], "") if allowed[k].any() else
                (None, NOTHING_ALLOWED) for k, job in enumerate(jobs)}  # (nothing, or only ids never generated)

    def _finished(self, job: Job) -> bool:
        # (the stop check first: a stop string completed by the job's last allowed token must still be seen, so that
        # the job ends by it and its text is cut there)
        if job.error:
            return True
        stopped = bool(job.settings.stop) and self.stop_check is not None and self.stop_check(job)
        return stopped or job.new[-1] == self.eos_id or len(job.new) >= job.budget

    def _finish_done(self) -> list[Outcome]:
        done = [r for r, job in enumerate(self.running) if self._finished(job)]
        if not done:
            return []
        out = [Outcome(self.running[r], "error" if self.running[r].error else "done") for r in done]
        for r in done:  # (the prompt and the answer's fed tokens: a conversation's next turn starts with them)
            job = self.running[r]
            self._remember(job, self.cache, r, job.prompt_ids + job.new[:-1])
        self._keep([r for r in range(len(self.running)) if r not in done])
        return out

    def _merge(self, jobs: list[Job], joining: DecodeCache) -> None:
        """Join new sequences' caches to the running batch's (the narrower left-padded with masked columns)."""
        if not self.running:
            self.running, self.cache = list(jobs), joining
            return
        self.cache.join(joining)
        self.running += jobs

    def _keep(self, rows: list[int]) -> None:
        self.running = [self.running[r] for r in rows]
        if not rows:
            self.cache = None
            return
        self.cache.keep(rows)
