"""training/checkpoint/async_write.py's writer: tasks run in order; after the first failure (a full disk) nothing queued
after it runs -- above all not the completion marker of the checkpoint it belonged to -- and the training thread
gets the error at its next check."""
import threading

import pytest

from training.checkpoint.async_write import Writer


def test_tasks_run_in_order_and_drain_waits_for_them():
    writer, done = Writer(), []
    gate = threading.Event()
    writer.submit(gate.wait, 5)
    for i in range(5):
        writer.submit(done.append, i)
    assert done == []  # (held behind the first task)
    gate.set()
    writer.drain()
    assert done == [0, 1, 2, 3, 4]


def test_after_a_failed_write_nothing_queued_runs_and_the_error_reaches_the_trainer(tmp_path):
    writer, ran = Writer(), []
    marker = tmp_path / "checkpoint-4" / ".complete"

    def full_disk():
        raise OSError(28, "No space left on device")

    writer.submit(ran.append, "shard-0")
    writer.submit(full_disk)
    writer.submit(ran.append, "shard-1")
    writer.submit(lambda: marker.parent.mkdir() or marker.write_text("done"))
    with pytest.raises(RuntimeError, match="No space left on device"):
        writer.drain()
    assert ran == ["shard-0"] and not marker.exists()
    writer.submit(ran.append, "checkpoint-8")  # (a later save does not run either: the run must stop)
    with pytest.raises(RuntimeError, match="an asynchronous checkpoint write failed"):
        writer.drain()
    assert ran == ["shard-0"]
    with pytest.raises(RuntimeError):
        writer.check()
