"""The path of a setting through the code: the repository files whose functions are handed it (the whole `Config`, or
the section that holds it), in the order they are entered, in every process of a command, and how often the path
climbs back from a lower layer to a higher one (layers: tests/unit/test_layers.py LAYERS).

    python tests/walk/setting_walk.py finetune.method -- python -m pipeline finetune --model <run> ...

A file entered, left for a lower layer and entered again counts once in `files`; every step up counts in `climbs`. A
method of the value itself (`config.layout()`, a section's `check()`) is the value, not a hand-off: counted only in
`files_with_own_methods` / `climbs_with_own_methods`. Each process is traced by tests/walk/sitecustomize.py
(sys.setprofile), so ranks started by the launcher count too.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tests.unit.test_layers import LAYERS  # noqa: E402

# a section -> the class of its config (core/config.py): what carries a setting besides the whole Config
SECTION_CLASSES = {"model": "ModelConfig", "data": "DataConfig", "tokenizer": "TokenizerConfig",
                   "training": "TrainingConfig", "parallel": "ParallelConfig", "performance": "PerformanceConfig",
                   "tracking": "TrackingConfig", "export": "ExportConfig", "serving": "ServingConfig",
                   "cluster": "ClusterConfig", "storage": "StorageConfig", "finetune": "FinetuneConfig",
                   "gateway": "GatewayConfig", "visualdl": "VisualDLConfig"}


def layer(path: str) -> int:
    return LAYERS.get(path.split("/")[0], -1)


def _collapsed(seq: list[str]) -> list[str]:
    return [f for i, f in enumerate(seq) if i == 0 or seq[i - 1] != f]


def walk(records: list[list[str]]) -> dict:
    """`files` and `climbs` count the files whose functions are handed the value; `*_with_own_methods` also count
    entering a file through a method of the value itself (Config.layout(), a section's check())."""
    out = {}
    for suffix, keep in (("", lambda f: not f.endswith("#own")), ("_with_own_methods", lambda f: True)):
        seqs = [_collapsed([f.removesuffix("#own") for f in seq if keep(f)]) for seq in records]
        files = sorted({f for seq in seqs for f in seq})
        out["files" + suffix] = len(files)
        out["climbs" + suffix] = sum(1 for seq in seqs for a, b in zip(seq, seq[1:]) if layer(b) > layer(a))
        if not suffix:
            entered = {}
            for seq in seqs:
                for f in seq:
                    entered[f] = entered.get(f, 0) + 1
            out.update(packages=sorted({f.split("/")[0] for f in files}), entered=dict(sorted(entered.items())))
    return {**out, "processes": len(records)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("setting", help="section.key, e.g. finetune.method")
    p.add_argument("--calls", action="store_true", help="also print each process's functions, in order")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- the command to follow it through")
    args = p.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    section = args.setting.split(".")[0]
    out = Path(tempfile.mkdtemp(prefix="walk-"))
    env = dict(os.environ, WALK_ROOT=str(ROOT) + os.sep, WALK_OUT=str(out),
               WALK_TYPES=f"Config,{SECTION_CLASSES[section]}",
               PYTHONPATH=os.pathsep.join([str(ROOT / "tests" / "walk"), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    rc = subprocess.call(command, env=env, cwd=ROOT)
    traced = [json.loads(f.read_text()) for f in sorted(out.glob("*.json"))]
    result = walk([t["files"] for t in traced])
    if args.calls:
        result["calls"] = {" ".join(t["argv"][:2]): t["calls"] for t in traced}
    print(json.dumps({"setting": args.setting, "command": " ".join(command), "returncode": rc, **result}, indent=1))
    return rc


if __name__ == "__main__":
    sys.exit(main())
