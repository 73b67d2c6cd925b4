"""The console of `make train` (training/launch/console.py) from rank 0's progress events: plain lines when stdout is not a
terminal, a tqdm bar when it is, the ETA once a few steps are timed, notes passed through (fast, no training)."""
import io
import json
import re

from training.launch.console import Progress, duration


def _events(run_dir, events):
    with open(run_dir / "progress.jsonl", "a") as fh:
        for event in events:
            fh.write(json.dumps(event) + "\n")


RUN = [{"kind": "start", "time": 100.0, "max_steps": 1000, "step": 0, "tokens_per_step": 2048,
        "train_tokens": 1_024_000}] + \
      [{"kind": "log", "time": 100.0 + 0.5 * s, "step": s, "loss": 8.0 - s / 10, "learning_rate": 1e-3,
        "tokens_per_second": 4096.0} for s in range(1, 11)] + \
      [{"kind": "eval", "time": 105.1, "step": 10, "eval_loss": 7.25},
       {"kind": "note", "time": 105.2, "text": "[mlflow] WARNING: logging failed"}]


def _show(tmp_path, tty: bool) -> str:
    stream = io.StringIO()
    progress = Progress(tmp_path, stream=stream, tty=tty, every_s=3600, poll_s=0.01)
    progress.start()
    _events(tmp_path, RUN)
    progress.stop()
    return stream.getvalue()


def test_plain_lines_when_not_a_terminal(tmp_path):
    out = _show(tmp_path, tty=False).splitlines()
    # the start line says how much training this is: 1000 x 2048 tokens = 2 epochs of the corpus
    assert out[0] == "training steps 1..1000: 2,048 tokens a step, 2.05M tokens = 2.00 epochs of the 1.02M " \
                     "training tokens"
    # the first timed steps give the ETA: 0.5 s a step for the remaining 997 steps
    assert "timed 3 steps: about 0:08:18 for the remaining 997 steps" in out
    evaluated = next(line for line in out if "eval_loss" in line)
    assert re.fullmatch(r"step\s+10/1000 \(\s+1%\)  loss 7\.0000  eval_loss 7\.2500  4,096 tok/s  ETA 0:08:24",  # 5.1 s / 10 steps x 990
                        evaluated), evaluated
    assert out[-1] == "[mlflow] WARNING: logging failed"


def test_an_evaluation_step_prints_one_line(tmp_path):
    """Each step's log line is due (every_s=0), but step 10 is evaluated: its line waits for the eval loss."""
    stream = io.StringIO()
    progress = Progress(tmp_path, stream=stream, tty=False, every_s=0, poll_s=0.01)
    progress.start()
    _events(tmp_path, [{**RUN[0], "eval_every": 5}, *RUN[1:]])
    progress.stop()
    steps = [line.split()[1] for line in stream.getvalue().splitlines() if line.startswith("step ")]
    assert steps == ["1/1000", "2/1000", "3/1000", "4/1000", "6/1000", "7/1000", "8/1000", "9/1000", "10/1000"]
    # step 5's eval never came (a crash, say): no line for it; step 10's is the one with its eval loss
    assert "eval_loss 7.2500" in stream.getvalue().splitlines()[-2]


def test_a_progress_bar_on_a_terminal(tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "160")  # (the bar is as wide as the terminal; a narrow one cuts the line)
    out = _show(tmp_path, tty=True)
    assert "10/1000" in out and "loss 7.0000  eval_loss 7.2500  4,096 tok/s" in out
    assert "\r" in out  # redrawn in place
    assert "[mlflow] WARNING: logging failed" in out


def test_a_resume_reads_only_its_own_events(tmp_path):
    _events(tmp_path, RUN)  # the interrupted run's events are already in the file
    stream = io.StringIO()
    progress = Progress(tmp_path, stream=stream, tty=False, every_s=3600, poll_s=0.01)
    progress.start()
    _events(tmp_path, [{"kind": "start", "time": 200.0, "max_steps": 1000, "step": 10, "tokens_per_step": 2048,
                        "train_tokens": 1_024_000}])
    progress.stop()
    assert stream.getvalue().splitlines() == [
        "training steps 11..1000: 2,048 tokens a step, 2.03M tokens = 1.98 epochs of the 1.02M training tokens"]


def test_durations():
    assert [duration(s) for s in (0, 59.9, 3599, 86400 * 3 + 61)] == ["0:00:00", "0:00:59", "0:59:59", "3d 0:01:01"]
