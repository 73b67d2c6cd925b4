"""`make bench`: the benchmark suite (suite.py drives it and writes reports/bench/bench.{json,md} and the MLflow
experiment `bench`); training_speed.py runs one CPU-runtime setting in a fresh process, serving_load.py measures the
serving endpoint under concurrent clients. Top layer: it drives the verbs and the stages, nothing imports it."""
import core  # noqa: F401  (zlib before paddle)


def spread(values: list[float]) -> dict:
    """Median and range of repeated trials (every section reports its figures so)."""
    import statistics

    return {"median": float(statistics.median(values)), "min": float(min(values)), "max": float(max(values)),
            "n": len(values)}
