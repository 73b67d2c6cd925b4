"""What the training ranks tell the person at the console, as events in `<run dir>/progress.jsonl`.

PaddleNLP's own output (its argument dump, INFO lines every logging step, Paddle's warnings) goes to the rank logs
under `<run dir>/logs/` only; the launcher (training/launch/console.py) follows this file instead and shows a progress bar
on a terminal, or plain lines elsewhere. Rank 0 writes it: `start` (steps, tokens per step, the corpus size),
`log` (step, loss, learning rate, tokens/s), `eval`, `checkpoint`, `note` (a message for people: tracking outages,
retention), `end`. One JSON object per line, appended as it happens (rank 0 runs on node 0, whose launcher
reads it).
"""
from __future__ import annotations

import json
import time
from pathlib import Path
import sys

PROGRESS_FILE = "progress.jsonl"


def write(run_dir: Path | str, kind: str, **fields) -> None:
    """Append one event; never fails the training over a console message (a full disk, say)."""
    try:
        with open(Path(run_dir) / PROGRESS_FILE, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"kind": kind, "time": time.time(), **fields}, ensure_ascii=False) + "\n")
    except OSError:
        pass


def note(run_dir: Path | str | None, text: str) -> None:
    """A message for the console (rank 0), also printed to this rank's log."""
    print(text, file=sys.stderr, flush=True)
    if run_dir is not None:
        write(run_dir, "note", text=text)


def progress_callback(run_dir: Path, seq_length: int, global_batch_size: int, train_blocks: int):
    from paddlenlp.trainer import TrainerCallback

    class ProgressLog(TrainerCallback):
        """Rank 0's training progress as events for the launcher's console."""

        def on_train_begin(self, args, state, control, **kwargs):
            if state.is_world_process_zero:
                steps = str(getattr(args.evaluation_strategy, "value", args.evaluation_strategy)) == "steps"
                write(run_dir, "start", max_steps=int(state.max_steps), step=int(state.global_step),
                      tokens_per_step=seq_length * global_batch_size, train_tokens=seq_length * train_blocks,
                      eval_every=int(args.eval_steps or 0) if args.do_eval and steps else 0)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not state.is_world_process_zero or not logs:
                return
            step = int(state.global_step)
            if "loss" in logs:
                # (the Trainer's interval sample rate counts the global batch: this is the global token rate)
                rate = logs.get("interval_samples_per_second")
                write(run_dir, "log", step=step, loss=float(logs["loss"]),
                      learning_rate=float(logs.get("learning_rate", 0.0)),
                      tokens_per_second=float(rate) * seq_length if rate else None)
            if "eval_loss" in logs:
                write(run_dir, "eval", step=step, eval_loss=float(logs["eval_loss"]))

        def on_save(self, args, state, control, **kwargs):
            if state.is_world_process_zero:
                write(run_dir, "checkpoint", step=int(state.global_step))

        def on_train_end(self, args, state, control, **kwargs):
            if state.is_world_process_zero:
                write(run_dir, "end", step=int(state.global_step))

    return ProgressLog()
