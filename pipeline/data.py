"""`make data`: prepare the config's corpus as token shards (training/data/), or say that it is already prepared.
`make train` runs the same step when the data set is missing; on a cluster run this once first (data.engine=ray)."""
from __future__ import annotations

import time

from core.config import Config
from pipeline.runner.cli import config_argument, overrides_argument
from training.data.prepare import prepare

HELP = "prepare the corpus as token shards (reused when already prepared)"


def arguments(p) -> None:
    config_argument(p)
    overrides_argument(p, "section.key=value overrides, e.g. data.workers=4 data.engine=ray")


def run(config: Config) -> int:
    t0 = time.time()
    prepared = prepare(config, log=lambda line: print(line, flush=True))
    m = prepared.manifest
    train, validation = m["totals"]["train"], m["totals"]["validation"]
    seconds = time.time() - t0
    rate = "" if prepared.reused else f", {m['input_bytes'] / 1e6 / max(seconds, 1e-9):.2f} MB/s ({m['engine']})"
    print(f"data set {m['key']}: {'already prepared' if prepared.reused else 'prepared'} in {seconds:.1f}s{rate}\n"
          f"  {prepared.path}\n"
          f"  {train['documents']:,} train / {validation['documents']:,} validation documents, "
          f"{train['tokens']:,} / {validation['tokens']:,} tokens, "
          f"{sum(1 for s in m['shards'] if s['split'] == 'train')} shard(s) a split; "
          f"vocabulary {m['tokenizer']['vocab_size']} ({m['tokenizer']['dtype']}); corpora "
          + ", ".join(f"{c['name']} x{c['weight']:g} ({len(c['files'])} file(s))" for c in m["corpora"]),
          flush=True)
    return 0


def main(config: Config, args) -> int:
    return run(config)
