"""Training data: `make data` prepares a corpus into token shards (corpus, shards, engines, prepare), and a run
reads them memory-mapped (read). docs/data.md says what is written where.

    corpus    input files (globs, directories, txt/jsonl, gzip/zstd), pieces, documents, the train/validation rule
    shards    the per-piece worker: character counts, or one piece tokenized into a shard pair
    engines   where the workers run: local processes or Ray tasks
    prepare   the passes, the content key, staging and publishing, the manifest
    read      a run's training samples (PaddleNLP's causal dataset) and validation blocks

`for_run` links a new run directory to its data set (preparing it when missing) and builds the run's sample index.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from core import dataset
from core.errors import ConfigError
from core.tokenizer import VOCAB_MULTIPLE
from training.data.prepare import Prepared, prepare as prepare_dataset  # (training.data.prepare stays the module)
from training.data.read import RUN_DATA, available_memory, check_index, index_size

STATS_FILE = "stats.json"

__all__ = ["Prepared", "prepare_dataset", "for_run", "STATS_FILE"]


def run_index_size(config, manifest: dict) -> dict:
    """The sample index a run of `config` would build over the prepared set of `manifest` (training/data/read.py)."""
    tr = config.training
    train_shards = [s for s in manifest["shards"] if s["split"] == "train"]
    return index_size(manifest["totals"]["train"]["tokens"], sum(s.get("items", 0) for s in train_shards),
                      tr.seq_length, tr.max_steps * tr.global_batch_size, blended=len(train_shards) > 1)


def check_size_early(config) -> None:
    """Before anything starts (MLflow, paddle): refuse a step count whose index cannot be built, when the config's
    data set is prepared already (else `for_run` checks once it is). A pretraining run's: fine-tuning reads its own
    examples (training/finetune/data.py)."""
    from training.data.prepare import find_prepared

    manifest = find_prepared(config)
    if manifest is not None:
        check_index(run_index_size(config, manifest), config.training.max_steps, available_memory())


def for_run(config, run_dir: Path, log=print) -> tuple[dict, Prepared]:
    """Prepare (or find) the config's data set, copy its tokenizer into the run, record which set and which samples
    the run reads (data/dataset.json), build the sample index, and return the run's data statistics."""
    prepared = prepare_dataset(config, run_dir=run_dir, log=log)
    manifest, tr = prepared.manifest, config.training
    shutil.copytree(prepared.path / dataset.TOKENIZER_DIR, run_dir / "tokenizer")
    width, batch = tr.seq_length + 1, tr.global_batch_size
    totals = manifest["totals"]
    blocks = {split: totals[split]["tokens"] // width for split in dataset.SPLITS}
    for split in dataset.SPLITS:
        if blocks[split] < batch:
            raise ConfigError(f"the {split} split packs into {blocks[split]} blocks of {width} tokens, fewer than "
                              f"training.global_batch_size={batch}; use more data, a shorter training.seq_length, "
                              f"or a larger data.validation_fraction")
    size = run_index_size(config, manifest)
    run_tokens, corpus_tokens = tr.max_steps * batch * tr.seq_length, blocks["train"] * tr.seq_length
    log(f"run size: {tr.max_steps:,} steps x {batch * tr.seq_length:,} tokens = {run_tokens:,} tokens = "
        f"{run_tokens / max(corpus_tokens, 1):,.2f} epochs of the {corpus_tokens:,} training tokens; sample index: "
        f"{size['samples']:,} samples, ~{size['file_bytes'] / 2**20:,.0f} MB, ~{max(size['seconds'], 1):,.0f}s to "
        "build")
    check_index(size, tr.max_steps, available_memory())
    data_dir = run_dir / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    spec = {"path": str(prepared.path), "key": manifest["key"], "seq_length": tr.seq_length, "seed": tr.seed,
            "train_samples": tr.max_steps * batch, "global_batch": batch,
            "validation_blocks": min(blocks["validation"], tr.max_eval_batches * batch)}
    (data_dir / RUN_DATA).write_text(json.dumps(spec, indent=2))
    from training.data.read import train_dataset

    train_dataset(data_dir, quiet=True)  # (the index files, once, here: the ranks find them)
    vocab = manifest["tokenizer"]["vocab_size"]
    stats = {
        "dataset": manifest["key"], "shards": sum(1 for s in manifest["shards"] if s["split"] == "train"),
        "train_documents": totals["train"]["documents"], "validation_documents": totals["validation"]["documents"],
        "train_tokens": totals["train"]["tokens"], "validation_tokens": totals["validation"]["tokens"],
        "train_blocks": blocks["train"], "validation_blocks": spec["validation_blocks"], "vocab_size": vocab,
        "model_vocab_size": -(-vocab // VOCAB_MULTIPLE) * VOCAB_MULTIPLE,
        "unknown_rate": round(manifest["validation_unknown_rate"], 6),
        "blend": {c["name"]: c["weight"] for c in manifest["corpora"]},
    }
    (data_dir / STATS_FILE).write_text(json.dumps(stats, indent=2))
    return stats, prepared
