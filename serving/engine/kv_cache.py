"""The running batch's key/value cache, one object its user owns (the scheduler, `generate_batch`, the export's cache
gate) and every decode function writes into.

Keys and values [layers, B, kv heads, P, head dim] live in buffers with room to grow (GROW free columns), so that a
decode step writes only its new column instead of copying the whole cache into a wider array (np.concatenate: ~20% of
a step at 128 sequences, measured). The whole cache is copied only when the batch changes (sequences join: `join`;
sequences leave: `keep`) or the buffers are full (`append` grows them by GROW); `copies` counts those copies, so a
test sees a change that copies every step. The free columns are fed masked (model/llama.py MASKED: weight exactly 0
after the softmax).

A decode function is `decode(ids [B,1], cache) -> logits [B,V]`: it feeds `step_inputs()` (the buffers, the
positions and the mask widened to them, the new token's column last) and hands the step's new keys and values to
`append`."""
from __future__ import annotations

import numpy as np

GROW = 32


class DecodeCache:
    def __init__(self, keys: np.ndarray, values: np.ndarray, mask: np.ndarray, lengths: np.ndarray):
        """A prefill's caches (keys/values [L,B,H,T,D], mask [B,T], lengths [B]: the tokens each row holds)."""
        self.copies = 0
        self._place(keys, values, mask, np.asarray(lengths, dtype="int64"))

    def _place(self, keys, values, mask, lengths) -> None:
        """Copy the used caches into fresh buffers with GROW free columns (the one whole-cache copy)."""
        used = keys.shape[3]
        shape = list(keys.shape)
        shape[3] = used + GROW
        # (empty, then the used columns copied and only the free ones zeroed: each byte written once; a free column
        # is masked, but it must hold finite numbers: 0 x NaN is NaN in the attention's weighted sum)
        self._keys, self._values = np.empty(shape, dtype=keys.dtype), np.empty(shape, dtype=values.dtype)
        self._keys[:, :, :, :used], self._values[:, :, :, :used] = keys, values
        self._keys[:, :, :, used:], self._values[:, :, :, used:] = 0.0, 0.0
        self._mask = np.zeros((mask.shape[0], used + GROW), dtype="float32")
        self._mask[:, :used] = mask
        self.used, self.lengths = used, lengths
        self.copies += 1
        self.external = None  # (a decode session's own view of the buffers: runtime.py reads them in place)

    # -- what the batch holds ---------------------------------------------------------------------------------------
    @property
    def rows(self) -> int:
        return self._keys.shape[1]

    @property
    def capacity(self) -> int:
        return self._keys.shape[3]

    @property
    def keys(self) -> np.ndarray:
        return self._keys[:, :, :, :self.used]

    @property
    def values(self) -> np.ndarray:
        return self._values[:, :, :, :self.used]

    @property
    def mask(self) -> np.ndarray:
        return self._mask[:, :self.used]

    # -- a decode step ----------------------------------------------------------------------------------------------
    def step_inputs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(positions [B,1], keys, values, mask [B, capacity+1]) as a decode program takes them: the whole buffers,
        free columns masked, the new token's column last."""
        wide = np.zeros((self.rows, self.capacity + 1), dtype="float32")
        wide[:, :self.used], wide[:, self.capacity] = self._mask[:, :self.used], 1.0
        return self.lengths[:, None].copy(), self._keys, self._values, wide

    def append(self, new_keys: np.ndarray, new_values: np.ndarray) -> None:
        """The step's keys and values ([L,B,H,1,D]) into the next free column; the buffers grow when full."""
        if self.used == self.capacity:
            self._place(self.keys, self.values, self.mask, self.lengths)
        self._keys[:, :, :, self.used], self._values[:, :, :, self.used] = new_keys[:, :, :, 0], new_values[:, :, :, 0]
        self._mask[:, self.used] = 1.0
        self.used += 1
        self.lengths = self.lengths + 1

    # -- the batch changes ------------------------------------------------------------------------------------------
    def join(self, other: "DecodeCache") -> None:
        """`other`'s rows after this one's, the narrower left-padded with masked columns."""
        width = max(self.used, other.used)
        pad = lambda a, axis: _left_pad(a, width, axis)  # noqa: E731
        self._place(np.concatenate([pad(self.keys, 3), pad(other.keys, 3)], axis=1),
                    np.concatenate([pad(self.values, 3), pad(other.values, 3)], axis=1),
                    np.concatenate([pad(self.mask, 1), pad(other.mask, 1)], axis=0),
                    np.concatenate([self.lengths, other.lengths]))

    def keep(self, rows: list[int]) -> None:
        """Only these rows, in this order; leading columns no remaining row uses are dropped."""
        mask = self.mask[rows]
        used = np.flatnonzero(mask.any(axis=0))
        start = int(used[0]) if len(used) else 0
        self._place(self.keys[:, rows, :, start:], self.values[:, rows, :, start:], mask[:, start:], self.lengths[rows])


def _left_pad(array: np.ndarray, width: int, axis: int) -> np.ndarray:
    missing = width - array.shape[axis]
    if missing <= 0:
        return array
    spec = [(0, 0)] * array.ndim
    spec[axis] = (missing, 0)
    return np.pad(array, spec)
