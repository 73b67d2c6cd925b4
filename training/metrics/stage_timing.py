"""Per-stage pipeline timing: what each stage's forward and backward cost, and the order Paddle ran them in.

Wraps the methods of the one fleet pipeline engine instance this rank trains with (`PipelineParallel` or an
interleaved subclass): `forward_backward_pipeline` marks and times each training step (evaluation also runs
`_forward_step`, outside it or with forward_only), `_forward_step` / `_backward_step` each micro-batch's
compute, and forward hooks on the decoder layers split a stage's forward into decoder layers and the rest
(embedding, norm, LM head, loss) for the balancing advice. The first training step is warm-up and not counted.
On GPU every stamp synchronises the device, so the numbers are compute times there too.

`write()` leaves `pipeline_parallel/rank<r>.json` in the run directory; the launcher turns them into the timeline, the MLflow
metrics and the advice (training/metrics/stage_report.py). Paddle's own order for this stage comes from the engine's
`get_static_scheduler()` (it prints the schedule without running it).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

STAGE_DIR = "pipeline_parallel"  # (in the run directory, VisualDL's logs and the MLflow run's artifacts)


class StageTimer:
    def __init__(self, engine, device: str):
        self.engine = engine
        self.sync = device == "gpu"
        self.active = False
        self.steps = 0  # counted training steps (after the warm-up step)
        self.totals = {"forward": 0.0, "backward": 0.0, "decoder_forward": 0.0, "pipeline": 0.0}
        self.calls = {"forward": 0, "backward": 0}
        self.decoder_layers = 0
        self.last: dict | None = None  # the last timed step's own times (take_last)
        self._seen = {"forward": 0.0, "backward": 0.0, "pipeline": 0.0}  # the totals at the end of the step before
        try:
            self.paddle_order = engine.get_static_scheduler()
        except TypeError:  # the F-then-B engine has no static scheduler
            self.paddle_order = ""
        self._wrap()

    def _now(self) -> float:
        if self.sync:
            import paddle

            paddle.device.synchronize()
        return time.perf_counter()

    def _timed(self, name: str, method, counted: bool):
        def wrapper(*args, **kwargs):
            if not self.active:
                return method(*args, **kwargs)
            start = self._now()
            out = method(*args, **kwargs)
            self.totals[name] += self._now() - start
            if counted:
                self.calls[name] += 1
            return out
        return wrapper

    def _wrap(self) -> None:
        e = self.engine
        e._forward_step = self._timed("forward", e._forward_step, True)
        e._backward_step = self._timed("backward", e._backward_step, True)
        pipeline_step = e.forward_backward_pipeline

        def timed_pipeline_step(*args, **kwargs):
            # PaddleNLP's Trainer calls this for every training step; evaluation runs it with forward_only (the
            # interleaved engines) or not at all (eval_batch of PipelineParallel).
            training = not kwargs.get("forward_only", False) and not kwargs.get("static_scheduler", False)
            if not training:
                return pipeline_step(*args, **kwargs)
            self.active = self.steps_seen > 0  # step 1: warm-up (allocation, first-call caches)
            start = self._now()
            try:
                return pipeline_step(*args, **kwargs)
            finally:
                if self.active:
                    self.totals["pipeline"] += self._now() - start
                    self._step_done()
                self.steps += int(self.active)
                self.steps_seen += 1
                self.active = False

        self.steps_seen = 0
        e.forward_backward_pipeline = timed_pipeline_step
        for layer in e._layers.sublayers():
            if type(layer).__name__ == "LlamaDecoderLayerPipe":
                self.decoder_layers += 1
                layer.register_forward_pre_hook(self._decoder_start)
                layer.register_forward_post_hook(self._decoder_end)

    def _step_done(self) -> None:
        """This step's own times (ms): what `take_last` hands the stage's VisualDL writer (training/metrics/visualdl_writers.py)."""
        seen = {k: self.totals[k] for k in self._seen}
        delta = {k: 1000 * (seen[k] - self._seen[k]) for k in seen}
        self._seen = seen
        self.last = {"forward_ms": delta["forward"], "backward_ms": delta["backward"], "step_ms": delta["pipeline"],
                     "idle_ms": max(0.0, delta["pipeline"] - delta["forward"] - delta["backward"])}

    def take_last(self) -> dict | None:
        """The last timed step's times, once (None before the first timed step or when already taken)."""
        last, self.last = self.last, None
        return last

    def _decoder_start(self, layer, inputs):
        if self.active:
            self._decoder_t0 = self._now()

    def _decoder_end(self, layer, inputs, outputs):
        if self.active:
            self.totals["decoder_forward"] += self._now() - self._decoder_t0

    def record(self) -> dict:
        e = self.engine
        micro = max(self.calls["forward"], 1)
        return {
            "stage": e.stage_id, "stages": e.num_stages, "rank": e.global_rank,
            "virtual_stages": getattr(e, "num_model_chunks", 1), "decoder_layers": self.decoder_layers,
            "steps": self.steps, "micro_batches": self.calls["forward"],
            # per micro-batch, summed over this device's chunks (one micro-batch through the whole stage)
            "forward_ms": 1000 * self.totals["forward"] / micro * getattr(e, "num_model_chunks", 1),
            "backward_ms": 1000 * self.totals["backward"] / max(self.calls["backward"], 1)
            * getattr(e, "num_model_chunks", 1),
            "decoder_forward_share": self.totals["decoder_forward"] / max(self.totals["forward"], 1e-12),
            "pipeline_ms_per_step": 1000 * self.totals["pipeline"] / max(self.steps, 1),
            "busy_ms_per_step": 1000 * (self.totals["forward"] + self.totals["backward"]) / max(self.steps, 1),
            "paddle_order": self.paddle_order,
        }

    def write(self, run_dir: Path) -> None:
        out = Path(run_dir) / STAGE_DIR
        out.mkdir(exist_ok=True)
        (out / f"rank{self.engine.global_rank}.json").write_text(json.dumps(self.record(), indent=1))


def read(run_dir: Path) -> list[dict]:
    """Every rank's record, stage 0 first (tensor/data replicas of a stage included)."""
    files = sorted((Path(run_dir) / STAGE_DIR).glob("rank*.json"))
    return sorted((json.loads(f.read_text()) for f in files), key=lambda r: (r["stage"], r["rank"]))
