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
  head evicted first would leave its tail unreachable). The blocks an insert adds are views of one copy: that copy
  is freed when its last block goes (a chain's blocks go together, tail first).

Why answers stay the same: positions count real tokens only and the keys are stored after rotary, so a prompt's
first p tokens have the same keys and values whatever the batch, padding or request they were computed in (up to
float rounding, which export's extend parity gate bounds: export/gates.py extend_parity_error).
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np


class PrefixCache:
    def __init__(self, budget_bytes: int, block: int = 8, scope: str = ""):
        self.budget, self.block, self.scope = int(budget_bytes), int(block), scope
        self._blocks: OrderedDict[bytes, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self.bytes = 0
        self.queried = self.hits = self.evictions = 0  # tokens looked up, tokens found, blocks evicted

    def chain(self, ids: list[int], consumer: str = "", known: list[bytes] = ()) -> list[bytes]:
        """The chained keys of `ids`' whole blocks (`known`: those of a prefix of them, not hashed again)."""
        keys = list(known[:len(ids) // self.block])
        previous = keys[-1] if keys else hashlib.sha256(f"{self.scope}\0{consumer}".encode()).digest()
        for start in range(len(keys) * self.block, len(ids) - self.block + 1, self.block):
            previous = hashlib.sha256(previous + np.asarray(ids[start:start + self.block], "<i8").tobytes()).digest()
            keys.append(previous)
        return keys

    def lookup(self, ids: list[int], chain: list[bytes]) -> tuple[int, np.ndarray | None, np.ndarray | None]:
        """(tokens found, their keys [L,Hkv,n,D], values): the longest cached prefix of `ids` (`chain`: its keys)
        in whole blocks, its last token never included."""
        self.queried += len(ids)
        found = []
        for key in chain[:(len(ids) - 1) // self.block]:
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

    def insert(self, chain: list[bytes], blocks) -> int:
        """Cache the blocks of `chain` not held; `blocks(first, stop)` -> (keys, values) [L,Hkv,(stop-first)*block,D]
        of blocks first..stop-1, called once (one copy out of the batch's cache, each block a view of it). Returns
        the blocks added."""
        missing = [i for i, key in enumerate(chain) if key not in self._blocks]
        added = 0
        if missing:
            first, b = missing[0], self.block
            keys, values = blocks(first, len(chain))
            for i in missing:
                at = (i - first) * b
                entry = (keys[:, :, at:at + b], values[:, :, at:at + b])
                size = entry[0].nbytes + entry[1].nbytes
                if size > self.budget:
                    break
                self._blocks[chain[i]] = entry
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
