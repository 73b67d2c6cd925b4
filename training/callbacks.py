"""Trainer callbacks that steer the run: the final step rated and saved, graceful stop on SIGTERM / SIGINT, and the
switch to a new config once a resume has started. (What a run records: training/metrics/; after a checkpoint save:
training/checkpoint/manager.py.)"""
from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

from paddlenlp.trainer import TrainerCallback  # (this import resets SIGTERM: handlers are installed after it)


class FinalStepCallback(TrainerCallback):
    """Evaluate and save at the last step too, so the final weights are always a complete, rated checkpoint
    (PaddleNLP's DefaultFlowCallback only saves on multiples of save_steps)."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= state.max_steps:
            control.should_evaluate = True
            control.should_save = True
        return control


class GracefulStop(TrainerCallback):
    """SIGTERM / SIGINT: finish the current step, save a complete checkpoint, stop.

    The handler only sets a flag. At every step end the ranks agree (all-reduce MAX of the flag over the global
    group), so all of them stop after the same step even if the signal reached them at different times — a rank
    that stopped alone would leave its peers waiting in a collective."""

    def __init__(self, marker: Path | None = None):
        self.requested, self.marker = 0, marker
        self.install()

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._request)

    def on_train_begin(self, args, state, control, **kwargs):
        self.install()  # again, in case anything during set-up reset the handlers (as `import paddlenlp` does)

    def _request(self, signum, frame):
        if not self.requested:
            print(f"[rank {os.environ.get('PADDLE_TRAINER_ID', '0')}] {signal.Signals(signum).name}: saving a "
                  f"checkpoint after this step, then stopping", file=sys.stderr, flush=True)
        self.requested = int(signum)

    def agreed(self) -> int:
        """The signal any rank received (0 = none), the same on every rank."""
        import paddle
        import paddle.distributed as dist

        if dist.get_world_size() <= 1:
            return self.requested
        flag = paddle.to_tensor([self.requested], dtype="int32")
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.numpy()[0])

    def on_step_end(self, args, state, control, **kwargs):
        signum = self.agreed()
        if signum:
            control.should_save = True
            control.should_training_stop = True
            if state.is_world_process_zero and self.marker:
                # For the launcher: training ended early on a signal (it may have reached only the ranks, as when
                # a scheduler signals every process), so the run is KILLED, not FINISHED.
                self.marker.write_text(json.dumps({"step": state.global_step, "signal": signum}))
        return control


class PromoteConfig(TrainerCallback):
    """Resume with a changed config (e.g. another layout): the launcher writes it next to the run's config.yaml,
    and rank 0 moves it into place only once the resumed run has completed a step, so a resume that fails leaves
    the run as it was."""

    def __init__(self, pending: Path | None, target: Path, owner: bool):
        self.pending, self.target, self.owner = pending, target, owner  # (owner: rank 0, or each node's first rank
        # when every node has its own run directory)

    def on_step_end(self, args, state, control, **kwargs):
        if self.pending and self.owner and self.pending.exists():
            os.replace(self.pending, self.target)
        self.pending = None
        return control
