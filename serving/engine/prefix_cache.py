"""A worker's prefix cache: the keys and values of prompt prefixes it has computed, so that a request repeating one
(a shared system prompt, a conversation's earlier turns, few-shot examples) runs only the rest through the extend
program (export/programs.py). As vLLM's automatic prefix caching does:

- Token ids (never text) in blocks of `block` tokens; a block's key is a hash chained over every block before it
  and the scope (the model's weights and version, and the consumer where there is one), so a block is hit only
  behind the same whole prefix, of the same model, for the same tenant.
- Only whole blocks are cached, and at least a prompt's last token is always computed (its logits pick the first
  new token).
- Blocks are kept under `budget_bytes` (serving.prefix_cache_mb) and evicted least recently used first; a lookup or
  an insert touches a chain's blocks from the last to the first, so that a chain's tail goes before its head (a
  head evicted first would leave its tail unreachable).

Why answers stay the same: positions count real tokens only and the keys are stored after rotary, so a prompt's
first p tokens have the same keys and values whatever the batch, padding or request they were computed in (up to
float rounding, which export's extend parity gate bounds: export/gates.py extend_parity_error).
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np


class PrefixCache:
    def __init__(self, budget_bytes: int, block: int = 16, scope: str = ""):
        self.budget, self.block, self.scope = int(budget_bytes), int(block), scope
        self._blocks: OrderedDict[bytes, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self.bytes = 0
        self.queried = self.hits = self.evictions = 0  # tokens looked up, tokens found, blocks evicted

    def chain(self, ids: list[int], consumer: str = "") -> list[bytes]:
        """The chained keys of `ids`' whole blocks."""
        keys, previous = [], hashlib.sha256(f"{self.scope}\0{consumer}".encode()).digest()
        for start in range(0, len(ids) - self.block + 1, self.block):
            previous = hashlib.sha256(previous + np.asarray(ids[start:start + self.block], "<i8").tobytes()).digest()
            keys.append(previous)
        return keys

    def lookup(self, ids: list[int], consumer: str = "") -> tuple[int, np.ndarray | None, np.ndarray | None]:
        """(tokens found, their keys [L,Hkv,n,D], values): the longest cached prefix of `ids` in whole blocks, its
        last token never included."""
        self.queried += len(ids)
        found = []
        for key in self.chain(ids[:-1], consumer):
            entry = self._blocks.get(key)
            if entry is None:
                break
            found.append((key, entry))
        if not found:
            return 0, None, None
        self._touch([key for key, _ in found])
        self.hits += len(found) * self.block
        return (len(found) * self.block, np.concatenate([k for _, (k, _) in found], axis=2),
                np.concatenate([v for _, (_, v) in found], axis=2))

    def insert(self, ids: list[int], keys, values, consumer: str = "") -> int:
        """Cache `ids`' whole blocks (keys, values: callables of (start, stop) -> [L,Hkv,stop-start,D], called only
        for the blocks not held); returns the blocks added."""
        chain = self.chain(ids, consumer)
        added = 0
        for i, key in enumerate(chain):
            if key in self._blocks:
                continue
            start, stop = i * self.block, (i + 1) * self.block
            entry = (np.ascontiguousarray(keys(start, stop)), np.ascontiguousarray(values(start, stop)))
            size = entry[0].nbytes + entry[1].nbytes
            if size > self.budget:
                break
            self._blocks[key] = entry
            self.bytes += size
            added += 1
            while self.bytes > self.budget:
                self._evict()
        self._touch([key for key in chain if key in self._blocks])
        return added

    def _touch(self, chain: list[bytes]) -> None:
        for key in reversed(chain):  # (the head most recent: the tail is evicted first)
            self._blocks.move_to_end(key)

    def _evict(self) -> None:
        _, (k, v) = self._blocks.popitem(last=False)
        self.bytes -= k.nbytes + v.nbytes
        self.evictions += 1

    def __len__(self) -> int:
        return len(self._blocks)
