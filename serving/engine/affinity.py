"""Which worker holds a prompt's prefix: the dispatcher's view of its workers' prefix caches
(serving/engine/prefix_cache.py), so that a request goes where its prefix is cached.

The server process never tokenizes (its workers do), so this view is kept in text: each worker's prompts and
answers as a chain of hashes over blocks of BLOCK_CHARS characters, the most recent `capacity` blocks per worker.
It is an estimate (a worker may have evicted a block this still lists; a model's own tokenizer may cut blocks
elsewhere), so it only steers: a wrong guess costs a cache miss, never a wrong answer. vLLM's router and SGLang's
cache-aware load balancer keep the same kind of approximate per-worker prefix tree.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict

BLOCK_CHARS = 16


def text_chain(text: str, consumer: str = "") -> list[bytes]:
    """Chained keys of `text`'s whole blocks of BLOCK_CHARS characters (the consumer part of the first)."""
    keys, previous = [], hashlib.blake2b(consumer.encode(), digest_size=16).digest()
    for start in range(0, len(text) - BLOCK_CHARS + 1, BLOCK_CHARS):
        previous = hashlib.blake2b(previous + text[start:start + BLOCK_CHARS].encode(), digest_size=16).digest()
        keys.append(previous)
    return keys


class Affinity:
    def __init__(self, capacity: int = 65536):
        self.capacity = capacity
        self._held: dict[object, OrderedDict[bytes, None]] = {}  # worker -> its recent blocks

    def matched(self, worker, chain: list[bytes]) -> int:
        """Leading blocks of `chain` the worker is believed to hold."""
        held = self._held.get(worker, {})
        count = 0
        for key in chain:
            if key not in held:
                break
            count += 1
        return count

    def record(self, worker, chain: list[bytes]) -> None:
        held = self._held.setdefault(worker, OrderedDict())
        for key in reversed(chain):  # (the head most recent, as the worker's own cache keeps them)
            held[key] = None
            held.move_to_end(key)
        while len(held) > self.capacity:
            held.popitem(last=False)

    def forget(self, worker) -> None:
        """A worker gone (died, retired): its cache went with it."""
        self._held.pop(worker, None)


def choose(workers: list, load, chain: list[bytes], affinity: Affinity, overloaded: int):
    """Of the workers whose load is less than `overloaded` above the least loaded's, the one believed to hold the
    longest prefix of `chain` (ties: the less loaded); `load(worker)`: its requests in flight. A prefix every worker
    holds (a shared system prompt) leaves the choice to the load."""
    least = load(min(workers, key=load))
    candidates = [w for w in workers if load(w) - least < overloaded]
    return max(candidates, key=lambda w: (affinity.matched(w, chain), -load(w)))
