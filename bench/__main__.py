"""`python -m bench [--quick] [--full] [--out DIR] [--sections ...] [--export DIR]` (`make bench`, `make bench
FULL=1`): the benchmark suite, bench/suite.py. Without --full (or --sections) the sections a person runs in 15 minutes
or less; each section says how long it takes before it starts.

A stopped bench leaves nothing behind: SIGTERM or SIGINT (a scheduler's time limit, Ctrl-C) unwinds it, so every
server it started is stopped and every child process it waits on is killed; when `make` itself is killed, this
process gets SIGTERM too (it dies with its parent). A server left by a bench that could not clean up (SIGKILL) is
found and stopped at the start of the next one, and `make stop` stops it too (serving/state.py register)."""
from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from bench import Stopped, on_stop_signal
from bench import suite
from core.processes import die_with_parent
from serving import controller
from serving.state import registered, unregister


def stop_leftovers(out) -> list[str]:
    """Servers an earlier bench left running (listed, or in this output directory): stopped now, one line each."""
    lines = []
    for state_dir in dict.fromkeys([*registered("bench"), *Path(out).glob("serving-*")]):
        state = controller.running(state_dir)
        if state:
            lines.append(f"[bench] a server left by an earlier bench is running (pid {state['pid']}, {state_dir}): "
                         "stopping it")
            print(lines[-1], flush=True)
            controller.stop(state_dir)
        else:
            unregister(state_dir)
    return lines


def parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, tuple[str, ...], tuple[str, ...]]:
    """The command line -> (arguments, sections, peers); an unknown section or peer ends it in one line."""
    p = argparse.ArgumentParser(prog="python -m bench", description="benchmark suite (reports/bench/bench.{json,md}, "
                                                                    "MLflow experiment bench)")
    p.add_argument("--quick", action="store_true", help="tiny settings: checks the harness, not the machine")
    p.add_argument("--out", default="", help="output directory (default reports/bench)")
    p.add_argument("--sections", default="", help="comma-separated subset of: " + ", ".join(suite.SECTIONS))
    p.add_argument("--full", action="store_true", help="every section (the layouts' training, runtime settings, data, "
                                                       "gateway too: ~40 min); without it " + ", ".join(suite.DEFAULT_SECTIONS)
                                                       + " (~15 min)")
    p.add_argument("--export", default="", help="serve and generate with this export directory (or models:/<name>/"
                                                "<version|@alias>) instead of training and exporting one (the serving "
                                                "and generate sections, and the peers)")
    p.add_argument("--peers", default="", help="comma-separated peers measured side by side on the same weights "
                                               "(opt-in, each in its own environment): vllm")
    args = p.parse_args(argv)

    # (peers alone, unless sections are named: `make bench PEERS=vllm` is the comparison, not the whole suite)
    sections = tuple(s for s in args.sections.split(",") if s) or (
        suite.SECTIONS if args.full else () if args.peers else suite.DEFAULT_SECTIONS)
    unknown = set(sections) - set(suite.SECTIONS)
    if unknown:
        p.error(f"unknown section(s) {', '.join(sorted(unknown))}; choose from {', '.join(suite.SECTIONS)}")
    peers = tuple(s for s in args.peers.split(",") if s)
    if set(peers) - {"vllm"}:
        p.error(f"unknown peer(s) {', '.join(sorted(set(peers) - {'vllm'}))}; choose from vllm")
    return args, sections, peers


def main(argv: list[str] | None = None) -> int:
    args, sections, peers = parse(argv)
    import paddlenlp  # noqa: F401  (its import resets SIGTERM to the default action: the handlers go after it)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_stop_signal)
    die_with_parent(signal.SIGTERM)
    out = suite.out_dir(args.out)
    try:
        stop_leftovers(out)
        suite.run(quick=args.quick, out=out, sections=sections, export=args.export, peers=peers)
    except Stopped as stopped:
        stop_leftovers(out)  # (a server whose start was interrupted, before the suite's own clean-up knew of it)
        print(f"[bench] stopped by {signal.Signals(stopped.signum).name}: its servers and processes are stopped",
              file=sys.stderr, flush=True)
        return 128 + stopped.signum
    return 0


if __name__ == "__main__":
    sys.exit(main())
