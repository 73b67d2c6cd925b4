"""`make stop` also stops a server a bench left running (listed by serving/state.py register), on a stand-in server
process (a real process group; no model needed)."""
import json
import subprocess

from core.config import load_config
from core.processes import group_alive


def test_make_stop_stops_a_server_a_bench_left_running(tmp_path, monkeypatch, capsys):
    from pipeline import stop
    from serving.state import STATE_FILE, register, registered

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    server = subprocess.Popen(["sleep", "300"], start_new_session=True)
    state_dir = tmp_path / "bench" / "serving-static"
    state_dir.mkdir(parents=True)
    (state_dir / STATE_FILE).write_text(json.dumps({"pid": server.pid, "drain_grace_s": 0.5}))
    register(state_dir, "bench")
    gone = tmp_path / "bench" / "serving-continuous"  # (listed, but its server died long ago)
    gone.mkdir()
    register(gone, "bench")
    assert set(registered("bench")) == {state_dir, gone}
    try:
        config = load_config(None, [f"training.runs_dir={tmp_path / 'runs'}"])
        assert stop.main(config, None) == 0
        server.wait(timeout=30)
        assert not group_alive(server.pid)
        out = capsys.readouterr().out
        assert "no server was running" in out
        assert f"stopped the server a bench left running (pid {server.pid}, {state_dir})" in out
        assert registered("bench") == []
    finally:
        if server.poll() is None:
            server.kill()


def test_a_stop_signal_landing_in_a_finalizer_still_stops_the_bench_at_its_next_trial(monkeypatch):
    """Python swallows an exception raised in a finalizer, the bench's Stopped included when SIGTERM's handler runs
    there; the handler's record makes the next trial raise it. (Before, the suite went on to its end.)"""
    import gc
    import signal

    import pytest

    import bench

    monkeypatch.setattr(bench, "_received", [])
    monkeypatch.setattr(signal, "signal", lambda signum, handler: None)  # (this process keeps its SIGTERM action)

    class Finalized:
        def __del__(self):
            bench.on_stop_signal(signal.SIGTERM, None)  # (as if SIGTERM arrived while this finalizer ran)

    Finalized()
    gc.collect()  # (swallowed: "Exception ignored in ... Finalized.__del__")
    with pytest.raises(bench.Stopped) as stopped:
        for _ in range(3):
            bench.between_trials()
    assert stopped.value.signum == signal.SIGTERM
