"""What `make train` shows a person: progress while the ranks train, from the events rank 0 writes to
`<run dir>/progress.jsonl` (training/metrics/progress.py). On a terminal a progress bar (tqdm: step/max, loss, latest eval
loss, tokens/s, ETA); elsewhere (CI, Slurm logs) a plain line at every evaluation and at most every `every_s`
seconds between them. PaddleNLP's own output stays in the rank logs under `<run dir>/logs/`.
"""
from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
import shutil

from training.metrics.progress import PROGRESS_FILE

TIMED_STEPS = 3  # logging events before an ETA is trusted


def _tokens(n: float) -> str:
    return f"{n / 1e9:,.2f}B" if n >= 1e9 else f"{n / 1e6:,.2f}M" if n >= 1e6 else f"{n:,.0f}"


def duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    text = f"{hours}:{rest // 60:02d}:{rest % 60:02d}"
    return f"{days}d {text}" if days else text


class Progress(threading.Thread):
    def __init__(self, run_dir: Path, stream=None, tty: bool | None = None, every_s: float = 10.0,
                 poll_s: float = 0.25):
        super().__init__(name="console", daemon=True)
        self.path = Path(run_dir) / PROGRESS_FILE
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty() if tty is None else tty
        self.every_s, self.poll_s = every_s, poll_s
        self.offset = self.path.stat().st_size if self.path.exists() else 0  # (a resume appends to the file)
        self.done = threading.Event()
        self.bar = None
        self.max_steps = self.step = self.first_step = self.eval_every = 0
        self.first_time = self.last_print = 0.0
        self.loss = self.eval_loss = self.tokens_per_second = None
        self.logs_seen = 0
        self.eta_said = False
        self._last_time = 0.0

    # -- reading -------------------------------------------------------------------------------------------------
    def run(self) -> None:
        while True:
            finished = self.done.is_set()
            for event in self._new_events():
                self.handle(event)
            if finished:
                break
            time.sleep(self.poll_s)
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def _new_events(self) -> list[dict]:
        try:
            with open(self.path, encoding="utf-8") as fh:
                fh.seek(self.offset)
                chunk = fh.read()
        except OSError:
            return []
        complete = chunk[:chunk.rfind("\n") + 1]  # (a line still being written waits for the next poll)
        self.offset += len(complete.encode("utf-8"))
        events = []
        for line in complete.splitlines():
            try:
                events.append(json.loads(line))
            except ValueError:
                continue
        return events

    def stop(self, timeout: float = 5.0) -> None:
        self.done.set()
        self.join(timeout)

    # -- showing -------------------------------------------------------------------------------------------------
    def handle(self, event: dict) -> None:
        kind = event.get("kind")
        if kind == "start":
            self.max_steps, self.step = event["max_steps"], event["step"]
            self.first_step, self.first_time = event["step"], event["time"]
            self.eval_every = event.get("eval_every", 0)
            total = event["tokens_per_step"] * (self.max_steps - self.step)
            epochs = total / event["train_tokens"] if event["train_tokens"] else float("nan")
            self._say(f"training steps {self.step + 1}..{self.max_steps}: {event['tokens_per_step']:,} tokens a step, "
                      f"{_tokens(total)} tokens = {epochs:,.2f} epochs of the {_tokens(event['train_tokens'])} "
                      f"training tokens")
            if self.tty:
                from tqdm import tqdm


                # (a terminal that reports no size, as some ptys do, would get a bar of width 0)
                self.bar = tqdm(total=self.max_steps, initial=self.step, unit="step", file=self.stream,
                                ncols=shutil.get_terminal_size((100, 20)).columns or 100, leave=True)
        elif kind == "log":
            self._advance(event)
            self.loss, self.tokens_per_second = event["loss"], event.get("tokens_per_second")
            self.logs_seen += 1
            if not self.eta_said and self.logs_seen >= TIMED_STEPS and self.eta() is not None:
                self.eta_said = True
                self._say(f"timed {self.step - self.first_step} steps: about {duration(self.eta())} for the "
                          f"remaining {self.max_steps - self.step:,} steps")
            if self.bar is None and time.time() - self.last_print >= self.every_s and not self._evaluates(self.step):
                self._line()  # (an evaluation step's line comes with its eval loss, once)
        elif kind == "eval":
            self._advance(event)
            self.eval_loss = event["eval_loss"]
            if self.bar is None:
                self._line()
        elif kind == "note":
            self._say(event["text"])
        if self.bar is not None:
            self.bar.set_postfix_str(self._fields(eta=False), refresh=True)

    def _evaluates(self, step: int) -> bool:
        """Does an eval event follow this step's log (every eval_every steps, and the last step)?"""
        return bool(self.eval_every) and (step % self.eval_every == 0 or step == self.max_steps)

    def _advance(self, event: dict) -> None:
        step = event["step"]
        if self.bar is not None and step > self.step:
            self.bar.update(step - self.step)
        self.step = max(self.step, step)
        self._last_time = event["time"]

    def eta(self) -> float | None:
        done = self.step - self.first_step
        if done <= 0 or self.logs_seen < TIMED_STEPS:
            return None
        return (self._last_time - self.first_time) / done * (self.max_steps - self.step)

    def _fields(self, eta: bool = True) -> str:
        parts = []
        if self.loss is not None:
            parts.append(f"loss {self.loss:.4f}")
        if self.eval_loss is not None:
            parts.append(f"eval_loss {self.eval_loss:.4f}")
        if self.tokens_per_second:
            parts.append(f"{self.tokens_per_second:,.0f} tok/s")
        remaining = self.eta() if eta else None
        if remaining is not None:
            parts.append(f"ETA {duration(remaining)}")
        return "  ".join(parts)

    def _line(self) -> None:
        width = len(str(self.max_steps))
        self._say(f"step {self.step:>{width}}/{self.max_steps} ({100 * self.step / max(1, self.max_steps):3.0f}%)  "
                  f"{self._fields()}")
        self.last_print = time.time()

    def _say(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)
