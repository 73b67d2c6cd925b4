"""Token-by-token generation over any `forward(input_ids[1, T]) -> logits[1, T, V]`.

The same function drives the served model (Paddle Serving's local predictor), the in-process predictor and the
dynamic model, so their greedy outputs can be compared exactly. No KV cache: the exported graph is the plain
full-sequence forward; for the model sizes served on CPU here that costs less than the request overhead.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np


@dataclass(frozen=True)
class GenerationSettings:
    max_new_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = no limit
    seed: int = 0


def generate(forward: Callable[[np.ndarray], np.ndarray], prompt_ids: list[int], settings: GenerationSettings,
             eos_id: int, banned_ids: list[int], usable_vocab: int, max_length: int) -> list[int]:
    """New token ids (stopping after the end token, at max_new_tokens, or at the model's max length)."""
    ids = list(prompt_ids)
    rng = np.random.default_rng(settings.seed)
    new: list[int] = []
    budget = min(settings.max_new_tokens, max_length - len(ids))
    for _ in range(max(budget, 0)):
        logits = np.asarray(forward(np.asarray([ids], dtype="int64")))[0, -1].astype("float64")
        logits[usable_vocab:] = -np.inf  # embedding rows padded past the tokenizer's vocabulary
        logits[banned_ids] = -np.inf
        if settings.temperature <= 0:
            token = int(np.argmax(logits))
        else:
            logits = logits / settings.temperature
            if settings.top_k > 0:
                cutoff = np.sort(logits)[-min(settings.top_k, usable_vocab)]
                logits[logits < cutoff] = -np.inf
            probs = np.exp(logits - logits.max())
            token = int(rng.choice(len(probs), p=probs / probs.sum()))
        new.append(token)
        ids.append(token)
        if token == eos_id:
            break
    return new
