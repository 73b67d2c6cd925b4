"""`python -m bench [--quick] [--out DIR]` (`make bench`): the benchmark suite, bench/suite.py."""
from __future__ import annotations

import argparse
import sys

import core  # noqa: F401  (zlib before paddle)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description="benchmark suite (reports/bench/bench.{json,md}, "
                                                                    "MLflow experiment bench)")
    p.add_argument("--quick", action="store_true", help="tiny settings: checks the harness, not the machine")
    p.add_argument("--out", default="", help="output directory (default reports/bench)")
    p.add_argument("--sections", default="", help="comma-separated subset of: runtime, scaling, serving, generate, data")
    args = p.parse_args(argv)
    from bench import suite

    sections = tuple(s for s in args.sections.split(",") if s) or suite.SECTIONS
    unknown = set(sections) - set(suite.SECTIONS)
    if unknown:
        p.error(f"unknown section(s) {', '.join(sorted(unknown))}; choose from {', '.join(suite.SECTIONS)}")
    suite.run(quick=args.quick, out=args.out or None, sections=sections)
    return 0


if __name__ == "__main__":
    sys.exit(main())
