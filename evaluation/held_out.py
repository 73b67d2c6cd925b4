"""The held-out set a registered version is judged on, and its identity (a digest of what is evaluated).

    pretraining   the validation split of the version's source run's prepared data set, cut as that run cut it (same
                  sequence length and blocks: the eval_loss training reported is reproduced), or every document of a
                  corpus, prepared with the version's own tokenizer (training/data/)
    fine-tuning   the run's validation examples (the rows its eval_loss was computed on) and its held-out task, each
                  example's messages rendered with the export's chat template
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from core import chat, dataset, tracking
from core.config import Config, ConfigError, load_config
from training.data import read
from training.finetune import data as sft
from training.finetune import preference
from training.data.prepare import prepare


def held_out_set(config: Config, client, export_dir: Path, meta: dict, data: str) -> dict:
    """{name, digest, blocks [N, seq + 1] int64, source}: the content that is evaluated and its identity."""
    if data:
        prepared = prepare(config.with_overrides(["data.source=files", f"data.files={json.dumps([data])}",
                                                   "data.blend=[]", f"tokenizer.path={export_dir / 'tokenizer'}",
                                                   "data.max_documents=0"]), log=lambda line: None)
        seq = config.training.seq_length
        blocks = np.concatenate([read.split_blocks(prepared.path, prepared.manifest, split, seq)
                                 for split in ("validation", "train")])
        key, name = prepared.manifest["key"], f"corpus {data}"
    elif _fine_tuned(run_dir := _source_run_dir(client, meta)):
        return fine_tuning_held_out(run_dir, export_dir)
    else:
        spec = _source_data(client, meta)
        manifest = dataset.load_manifest(spec["path"])
        blocks = read.validation_blocks(Path(spec["path"]), manifest, spec["seq_length"], spec["validation_blocks"])
        key, seq, name = spec["key"], spec["seq_length"], f"the validation split of {Path(spec['path']).name}"
    if not len(blocks):
        raise ConfigError(f"the held-out set ({name}) has no block of {seq + 1} tokens")
    identity = hashlib.sha256(f"{key}:{seq}:{len(blocks)}".encode()).hexdigest()[:16]
    return {"name": name, "digest": identity, "blocks": blocks, "dataset_key": key, "seq_length": seq}


def fine_tuning_held_out(run_dir: Path, export_dir: Path) -> dict:
    """A fine-tuning run's validation examples (the rows it computed eval_loss on, all of them) and its held-out
    task: each example's messages rendered with the export's chat template, and the expected answer."""
    config = load_config(run_dir / "config.yaml")
    if config.preference_tuning:  # (its rows are pairs: the supervised rows of the same conversations)
        rows = preference.supervised_rows(config, run_dir)
    else:
        rows = np.load(run_dir / "data" / sft.FILE.format(split="validation"))
    task = preference.held_out_task(config, chat.read(export_dir / "tokenizer"))
    key = hashlib.sha256(rows.tobytes() + json.dumps([t["prompt"] for t in task]).encode()).hexdigest()
    return {"name": f"the held-out examples of {config.finetune.data}", "digest": key[:16], "rows": rows,
            "task": task, "blocks": rows[:, 0], "dataset_key": key, "seq_length": config.training.seq_length}


def _fine_tuned(run_dir: Path) -> bool:
    """The source run is a fine-tuning run (its recorded config says so: Config.fine_tuning)."""
    return (run_dir / "config.yaml").is_file() and load_config(run_dir / "config.yaml").fine_tuning


def _source_run_dir(client, meta: dict) -> Path:
    return Path(client.get_run(meta["source_run_id"]).data.tags.get(tracking.TAG_RUN_DIR, ""))


def _source_data(client, meta: dict) -> dict:
    """The source run's data/dataset.json (which prepared set it read, and how it cut its validation split)."""
    run_dir = _source_run_dir(client, meta)
    spec_file = run_dir / "data" / "dataset.json"
    if not spec_file.is_file():
        raise ConfigError(f"the source run {meta['source_run_id']} has no prepared data set on this machine "
                          f"({spec_file}): pass DATA=<corpus> to evaluate on a corpus instead")
    return json.loads(spec_file.read_text())
