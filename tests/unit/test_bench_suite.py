"""`make bench`'s plan (bench/suite.py, bench/__main__.py): the default is the short suite, FULL=1 every section, and
each section says how long it takes before it starts -- from this output directory's last full-size run when there
is one."""
import json

from bench import suite


def test_each_section_announces_its_time_from_the_last_run_here_or_the_typical_one(tmp_path, capsys, monkeypatch):
    suite._start_clock(tmp_path)  # (no earlier run)
    suite.announce("decode", quick=False)
    suite.announce("sizes", quick=True)
    suite._close_section()
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"[bench] decode: about {suite.MINUTES['decode']:g} min (2 cores)",
                     "[bench] sizes: under a minute (--quick)"]
    assert set(suite._clock["took"]) == {"decode", "sizes"}
    (tmp_path / "bench.json").write_text(json.dumps({"quick": False, "section_s": {"serving": 246.0}}))
    suite._start_clock(tmp_path)
    suite.announce("serving", quick=False)
    suite.announce("generate", quick=False)
    assert capsys.readouterr().out.splitlines() == [
        "[bench] serving: about 4.1 min (its last run here)",
        f"[bench] generate: about {suite.MINUTES['generate']:g} min (2 cores)"]
    (tmp_path / "bench.json").write_text(json.dumps({"quick": True, "section_s": {"serving": 3.0}}))
    suite._start_clock(tmp_path)  # (a quick run's times say nothing of a full-size one)
    suite.announce("serving", quick=False)
    assert "(2 cores)" in capsys.readouterr().out


def test_the_default_bench_is_the_short_suite_and_full_runs_every_section(monkeypatch):
    import bench.__main__ as cli

    seen = {}
    monkeypatch.setattr(suite, "run", lambda **kw: seen.update(kw))
    monkeypatch.setattr(cli, "stop_leftovers", lambda out: [])
    monkeypatch.setattr(suite, "out_dir", lambda out: out)
    monkeypatch.setattr(cli.signal, "signal", lambda *a: None)  # (this test process keeps its own handlers)
    import core.processes

    monkeypatch.setattr(core.processes, "die_with_parent", lambda *a: None)
    assert cli.main(["--out", "x"]) == 0 and seen["sections"] == suite.DEFAULT_SECTIONS
    assert cli.main(["--out", "x", "--full"]) == 0 and seen["sections"] == suite.SECTIONS
    assert cli.main(["--out", "x", "--peers", "vllm"]) == 0 and seen["sections"] == ()
    assert set(suite.DEFAULT_SECTIONS) < set(suite.SECTIONS) and set(suite.MINUTES) >= set(suite.SECTIONS)
    # the short suite's typical minutes stay within the 15 the issue allows, with training + export included
    assert sum(suite.MINUTES[s] for s in (*suite.DEFAULT_SECTIONS, "training + export")) <= 15


def test_a_relative_output_directory_is_made_absolute(tmp_path, monkeypatch):
    """(the servers the bench starts run in another directory: `--out reports/x` named a service config they could
    not find, and the peer bench's server never started)"""
    monkeypatch.chdir(tmp_path)
    assert suite.out_dir("reports/x") == tmp_path / "reports" / "x" and (tmp_path / "reports" / "x").is_dir()
