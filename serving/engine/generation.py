"""Token-by-token generation: the sampling rule, and two ways to drive a model with it.

- `generate(forward, ...)`: the full-sequence path. `forward(input_ids[1, T]) -> logits[1, T, V]` re-runs the whole
  sequence for every new token (the exported `model.pdmodel`, the dynamic model): O(T) per token; kept as the
  reference and for `serving.generation: full`.
- `generate_batch(prefill, decode, ...)`: the key/value-cache path (`prefill.pdmodel` / `decode.pdmodel`, see
  export/programs.py) for several requests at once: prompts left-padded to a common length, one decode call per
  step for the whole batch, finished rows dropped from the batch. Each row's logits do not depend on the other rows
  (masked attention, its own positions) and each request samples with its own seeded generator, so a request's
  output does not depend on what it was batched with.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from serving.engine.kv_cache import DecodeCache
from serving.protocol import GenerationSettings


def choose(logits_row: np.ndarray, settings: GenerationSettings, rng, banned_ids: list[int],
           usable_vocab: int) -> int:
    """The next token from one position's logits: greedy at temperature 0, else (top-k) sampling with `rng`."""
    return choose_rows(np.asarray(logits_row)[None, :], [settings], [rng], banned_ids, usable_vocab)[0]


class StepLogits:
    """A decode step's logits as export format 4's program returns them: each row's argmax `greedy` [B], fetched,
    and the logits [B, V] fetched from the predictor only when a row needs them (`full()`: sampled, constrained,
    logprobs, or an argmax that is a banned or padding id). `step[r]` is row r's logits."""

    def __init__(self, greedy: np.ndarray, fetch):
        self.greedy, self._fetch, self._logits = greedy, fetch, None

    def full(self) -> np.ndarray:
        if self._logits is None:
            self._logits = self._fetch()
        return self._logits

    def __getitem__(self, row) -> np.ndarray:
        return self.full()[row]


def choose_rows(logits, settings: list[GenerationSettings], rngs: list, banned_ids: list[int],
                usable_vocab: int, allowed: dict[int, np.ndarray] | None = None) -> list[int]:
    """The next token of every row of a batch's logits [B, V] (an array, or a StepLogits: its logits fetched only
    when a row needs more than its argmax); each row's depends only on its own logits, settings and generator.
    Greedy rows share one argmax over the usable vocabulary, in float32 (the same order as float64; the program's
    own with a StepLogits), a row copied only when that argmax is a banned or padding id. Rows sampled at a
    temperature, with or without top-k (no top-p, no constraint), are drawn together (_draw_together: float32, one
    uniform number each); the others are copied to float64 one at a time and draw as `Generator.choice(p=)` does (cdf = cumsum(p) over its last value, one uniform
    number, searchsorted right: the same token), written out because choice's checks of p cost more than the draw.
    No whole-batch float64 copy: at a 151,936-token vocabulary and batch 128 it is 156 MB a step, each one fresh
    pages. `allowed` {row: booleans over the vocabulary}: a constrained row (serving/engine/constraints.py) chooses
    among its allowed tokens only, greedy or sampled the same way."""
    scores = None if isinstance(logits, StepLogits) else logits[:, :usable_vocab]  # (padded embedding rows out)
    greedy = logits.greedy if scores is None else scores.argmax(axis=1)
    banned = set(banned_ids)
    masked_ids = [i for i in banned_ids if i < usable_vocab]
    tokens, together = [], []
    for r, (s, rng) in enumerate(zip(settings, rngs)):
        mask = allowed.get(r) if allowed else None
        if mask is None and s.temperature <= 0 and int(greedy[r]) not in banned and greedy[r] < usable_vocab:
            tokens.append(int(greedy[r]))
            continue
        if scores is None:  # (the first row that needs more than its argmax: the step's logits fetched)
            scores = logits.full()[:, :usable_vocab]
        if SAMPLE_TOGETHER and mask is None and s.temperature > 0 and s.top_p >= 1.0:
            tokens.append(-1)
            together.append(r)
            continue
        if mask is not None:  # (one pass: the disallowed set to -inf as the row is copied; greedy stays float32)
            row = np.where(mask[:usable_vocab], scores[r], np.float32(-np.inf))
            row = row if s.temperature <= 0 else row.astype("float64")
        else:
            row = np.array(scores[r], dtype="float64")
        row[masked_ids] = -np.inf
        tokens.append(int(row.argmax()) if s.temperature <= 0 else _sample(row, s, rng.random()))
    for r, token in _draw_together(scores, together, settings, rngs, masked_ids).items():
        tokens[r] = token
    return tokens


def _draw_together(scores: np.ndarray, rows: list[int], settings: list, rngs: list, masked_ids: list[int]) -> dict:
    """{row: token} of the rows sampled at a temperature, with or without top-k (not top-p), one uniform number
    each: together in float32 when there are two or more (one row's own float64 draw costs less: 0.06 against 0.10
    ms at batch 1). A top-k row keeps the tokens at or above its k-th largest score, as _sample does."""
    uniforms = np.array([rngs[r].random() for r in rows])
    if len(rows) < 2:
        return {r: _draw_row(scores[r], settings[r], u, masked_ids) for r, u in zip(rows, uniforms)}
    picked = scores[rows]
    floors = np.full(len(rows), -np.inf, "float32")
    vocab = picked.shape[1]
    for k in {settings[r].top_k for r in rows} - {0}:
        group = [i for i, r in enumerate(rows) if settings[r].top_k == k]
        kth = vocab - min(k, vocab)
        candidates = picked[group]  # (a copy: banned ids out of the count, as _sample's -inf)
        candidates[:, masked_ids] = -np.inf
        floors[group] = np.partition(candidates, kth, axis=1)[:, kth]
    drawn = _sample_together(picked, np.array([settings[r].temperature for r in rows]), uniforms, masked_ids, floors)
    # (-1: float32 rounding put the draw on a token of probability 0; the float64 rule at the same number)
    return {r: int(token) if token >= 0 else _draw_row(scores[r], settings[r], u, masked_ids)
            for r, token, u in zip(rows, drawn, uniforms)}


def _draw_row(scores_row: np.ndarray, settings: GenerationSettings, uniform: float, masked_ids: list[int]) -> int:
    row = np.array(scores_row, dtype="float64")
    row[masked_ids] = -np.inf
    return _sample(row, settings, uniform)


SAMPLE_TOGETHER = True  # (False: every sampled row by the float64 rule, one at a time; the bench's before)
SAMPLE_BLOCK = 64  # _sample_together's cumulative sums run over blocks of this many tokens, then inside one


def _sample_together(scores: np.ndarray, temperatures: np.ndarray, uniforms: np.ndarray, masked_ids: list[int],
                     floors: np.ndarray | None = None) -> np.ndarray:
    """One draw from softmax(scores / temperature) per row, by the inverse of its cumulative distribution at its
    uniform number (the rule of _sample: the first token whose cumulative mass exceeds u x total), for all rows at
    once in float32. numpy's cumsum over [256, 4608] float32 took 3.9 ms (exp: 0.55), so the sums are of blocks of
    SAMPLE_BLOCK tokens (a pairwise sum), the cumulative sum over each row's blocks, then inside its one block: batch
    256 sampled in ~3 ms instead of 10 ms row by row (bench section "steps"). `floors`: each row's lowest score
    kept (top-k), -inf for all. -1 where rounding lands on a token of probability 0 (the caller redraws it in
    float64 with the same number)."""
    rows, vocab = scores.shape
    width = -(-vocab // SAMPLE_BLOCK) * SAMPLE_BLOCK
    weights = np.zeros((rows, width), "float32")  # (the tail past the vocabulary: probability 0)
    live = weights[:, :vocab]
    np.multiply(scores, (1.0 / temperatures).astype("float32")[:, None], out=live)
    live -= live.max(axis=1, keepdims=True)
    np.exp(live, out=live)
    live[:, masked_ids] = 0.0
    if floors is not None:
        live[scores < floors[:, None]] = 0.0
    blocks = weights.reshape(rows, -1, SAMPLE_BLOCK)
    ends = blocks.sum(axis=2).cumsum(axis=1)  # [rows, blocks]: the mass up to each block's end
    threshold = (uniforms * ends[:, -1]).astype("float32")
    block = np.minimum((ends <= threshold[:, None]).sum(axis=1), ends.shape[1] - 1)
    every = np.arange(rows)
    before = np.where(block > 0, ends[every, block - 1], 0.0).astype("float32")
    inside = blocks[every, block].cumsum(axis=1) + before[:, None]
    offset = np.minimum((inside <= threshold[:, None]).sum(axis=1), SAMPLE_BLOCK - 1)
    tokens = block * SAMPLE_BLOCK + offset
    return np.where(weights[every, tokens] > 0, tokens, -1)


def _sample(logits: np.ndarray, settings: GenerationSettings, uniform: float) -> int:
    """One draw from a float64 row (banned ids -inf) at `uniform` (the row's generator's next number)."""
    logits = logits / settings.temperature
    if settings.top_k > 0:
        kth = len(logits) - min(settings.top_k, len(logits))
        logits[logits < np.partition(logits, kth)[kth]] = -np.inf  # below the k-th largest
    probs = np.exp(logits - logits.max())
    if settings.top_p < 1.0:  # the smallest set of most likely tokens whose probability reaches top_p
        order = np.argsort(-probs, kind="stable")
        mass = (probs[order] / probs.sum()).cumsum()
        probs[order[int(mass.searchsorted(settings.top_p, side="left")) + 1:]] = 0.0
    cdf = (probs / probs.sum()).cumsum()
    cdf /= cdf[-1]
    return int(cdf.searchsorted(uniform, side="right"))


def token_logprobs(logits_row: np.ndarray, token: int, alternatives: int, banned_ids: list[int],
                   usable_vocab: int) -> dict:
    """The chosen token's log-probability under the model's distribution (banned and padding ids excluded) and the
    `alternatives` most likely tokens with theirs."""
    row = np.array(logits_row, dtype="float64")
    row[usable_vocab:] = -np.inf
    row[banned_ids] = -np.inf
    top = row.max()
    logp = row - (top + np.log(np.exp(row - top).sum()))
    best = np.argsort(-logp, kind="stable")[:alternatives] if alternatives else []
    return {"token": int(token), "logprob": float(logp[token]),
            "top": [(int(i), float(logp[i])) for i in best]}


def budget(prompt_length: int, settings: GenerationSettings, max_length: int) -> int:
    """New tokens a request may get: max_new_tokens, but never past the model's maximum length."""
    return max(0, min(settings.max_new_tokens, max_length - prompt_length))


def generate(forward: Callable[[np.ndarray], np.ndarray], prompt_ids: list[int], settings: GenerationSettings,
             eos_id: int, banned_ids: list[int], usable_vocab: int, max_length: int) -> list[int]:
    """New token ids (stopping after the end token, at max_new_tokens, or at the model's max length)."""
    ids = list(prompt_ids)
    rng = np.random.default_rng(settings.seed)
    new: list[int] = []
    for _ in range(budget(len(ids), settings, max_length)):
        token = choose(np.asarray(forward(np.asarray([ids], dtype="int64")))[0, -1], settings, rng, banned_ids,
                       usable_vocab)
        new.append(token)
        ids.append(token)
        if token == eos_id:
            break
    return new


def generate_batch(prefill, decode, prompts: list[list[int]], settings: list[GenerationSettings], eos_id: int,
                   banned_ids: list[int], usable_vocab: int, max_length: int, pad_id: int = 0) -> list[list[int]]:
    """New token ids for each prompt. `prefill(ids, positions, key_mask) -> (logits[B,V], keys, values)`, caches
    [layers, B, heads, T, head_dim], and `decode(ids[B,1], cache) -> logits` (serving/engine/kv_cache.py)."""
    budgets = [budget(len(p), s, max_length) for p, s in zip(prompts, settings)]
    rngs = [np.random.default_rng(s.seed) for s in settings]
    new: list[list[int]] = [[] for _ in prompts]
    rows = [i for i, b in enumerate(budgets) if b > 0]  # the requests still generating, in batch order
    if not rows:
        return new
    width = max(len(prompts[i]) for i in rows)
    ids = np.full((len(rows), width), pad_id, dtype="int64")
    mask = np.zeros((len(rows), width), dtype="float32")
    positions = np.zeros((len(rows), width), dtype="int64")
    for r, i in enumerate(rows):
        n = len(prompts[i])
        ids[r, width - n:], mask[r, width - n:], positions[r, width - n:] = prompts[i], 1.0, np.arange(n)
    logits, keys, values = prefill(ids, positions, mask)
    cache = DecodeCache(keys, values, mask, np.array([len(prompts[i]) for i in rows], dtype="int64"))
    while True:
        keep, tokens = [], []
        chosen = choose_rows(logits, [settings[i] for i in rows], [rngs[i] for i in rows], banned_ids, usable_vocab)
        for r, (i, token) in enumerate(zip(rows, chosen)):
            new[i].append(token)
            if token != eos_id and len(new[i]) < budgets[i]:
                keep.append(r)
                tokens.append(token)
        if not keep:
            return new
        if len(keep) < len(rows):  # finished requests leave the batch, with their caches
            rows = [rows[r] for r in keep]
            cache.keep(keep)
        logits = decode(np.asarray(tokens, dtype="int64")[:, None], cache)
