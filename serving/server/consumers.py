"""Token use per consumer, as the gateway names consumers (serving/protocol.py CONSUMER_HEADER, TPM_HEADER).

nginx knows requests, not tokens; the server counts every answer's tokens, so it keeps each consumer's tokens of
the last minute (a sliding window) and refuses a request while they have reached the consumer's tokens-per-minute
budget (429 rate_limited, with Retry-After: when enough of the window has passed). A request admitted under the
budget runs to its end, so a consumer can pass its budget by at most one request's tokens, as token buckets in other
gateways do. Requests without the header (straight to a replica: tests, bench, the host itself) are "direct" and
have no budget.
"""
from __future__ import annotations

import math
import threading
import time
from collections import deque

from serving.protocol import RequestError
from serving.protocol import CONSUMER_HEADER, TPM_HEADER

DIRECT = "direct"
WINDOW_S = 60.0


class TokenBudgets:
    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self._used: dict[str, deque] = {}  # consumer -> (time, tokens) of its answers in the window
        self._lock = threading.Lock()

    def check(self, consumer: str, tokens_per_minute: int) -> None:
        """RequestError("rate_limited") while `consumer`'s tokens of the last minute are at or over its budget."""
        if consumer == DIRECT or tokens_per_minute <= 0:
            return
        with self._lock:
            spent, window = self._window(consumer)
            if spent < tokens_per_minute:
                return
            # the earliest time enough tokens leave the window to be under the budget again
            over, wait = spent - tokens_per_minute, WINDOW_S
            for at, tokens in window:
                over -= tokens
                if over < 0:
                    wait = at + WINDOW_S - self.clock()
                    break
        raise RequestError("rate_limited", f"consumer {consumer!r} is over its tokens-per-minute budget ({spent} "
                           f"tokens in the last minute; this replica's share of the budget: {tokens_per_minute})",
                           retry_after=max(1, math.ceil(wait)))

    def spend(self, consumer: str, tokens: int) -> None:
        if consumer == DIRECT or tokens <= 0:
            return
        with self._lock:
            self._used.setdefault(consumer, deque()).append((self.clock(), tokens))

    def _window(self, consumer: str) -> tuple[int, deque]:
        window = self._used.setdefault(consumer, deque())
        while window and window[0][0] <= self.clock() - WINDOW_S:
            window.popleft()
        return sum(tokens for _, tokens in window), window


def consumer_of(headers) -> tuple[str, int]:
    """(consumer, tokens-per-minute budget; 0 = none) from the gateway's headers."""
    consumer = headers.get(CONSUMER_HEADER, "") or DIRECT
    budget = headers.get(TPM_HEADER, "0")
    return consumer, int(budget) if budget.isdigit() else 0
