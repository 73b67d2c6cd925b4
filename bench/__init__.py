"""`make bench`: the benchmark suite (suite.py drives it and writes reports/bench/bench.{json,md} and the MLflow
experiment `bench`); training_speed.py runs one CPU-runtime setting in a fresh process, serving_load.py measures the
serving endpoint under concurrent clients. Top layer: it drives the verbs and the stages, nothing imports it."""
import signal
import statistics

import core  # noqa: F401  (zlib before paddle)


class Stopped(BaseException):
    """SIGTERM / SIGINT to the bench, raised in the main thread so that every `finally` of the suite runs."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


_received: list[int] = []


def on_stop_signal(signum, frame) -> None:
    """The handler: records the signal, then raises Stopped where the main thread is. Python runs a handler between
    any two bytecodes, a finalizer's (`__del__`, a weakref callback) included, and an exception raised there is
    printed and swallowed; the record stays, and `between_trials` raises it at the suite's next trial."""
    signal.signal(signum, signal.SIG_IGN)  # (once: the clean-up itself must not be interrupted)
    _received.append(signum)
    raise Stopped(signum)


def between_trials() -> None:
    """Called by the suite before each trial: a stop signal received, even one whose raise was swallowed, stops it."""
    if _received:
        raise Stopped(_received[0])


def spread(values: list[float]) -> dict:
    """Median and range of repeated trials (every section reports its figures so)."""
    return {"median": float(statistics.median(values)), "min": float(min(values)), "max": float(max(values)),
            "n": len(values)}
