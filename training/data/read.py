"""What a run reads from a prepared data set (core/dataset.py), memory-mapped: a rank's memory does not grow with
the corpus.

    train       PaddleNLP's own causal dataset builder (`build_train_valid_test_datasets`) over the training shards,
                blended by corpus weight (each corpus's shards by their tokens): samples of seq_length + 1 tokens
                across document boundaries. Its index files are built once, by the launcher on node 0, in the run
                directory (`data/index/`); the ranks and every resume find them there.
    validation  the validation shards read in order and cut into blocks (each token once: a fixed held-out set)

The run directory's `data/dataset.json` names the data set and the settings that fix the index, so a resume reads
exactly the same samples whatever the layout.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path
import os
import sys

import numpy as np

from core import dataset
from core.errors import ConfigError

RUN_DATA = "dataset.json"
INDEX_DIR = "index"
# PaddleNLP's BlendableDataset keeps the dataset of each sample in a uint8 (assert num_datasets < 255).
MAX_TRAIN_SHARDS = 254


def train_prefixes(path: Path, manifest: dict) -> list:
    """PaddleNLP's data_prefix: [weight, prefix, weight, prefix, ...] (or [prefix] for a single shard)."""
    shards = dataset.shard_prefixes(path, manifest, "train")
    if len(shards) > MAX_TRAIN_SHARDS:
        corpora = len(manifest["corpora"])
        need_mb = -(-manifest.get("input_bytes", 0) // max(MAX_TRAIN_SHARDS - corpora, 1) // (1 << 20)) + 1
        raise ConfigError(f"the data set has {len(shards)} training shards ({corpora} corpora); PaddleNLP's "
                          f"blending takes at most {MAX_TRAIN_SHARDS}: prepare it again with data.shard_mb="
                          f"{need_mb} or more (pieces follow the corpus's size: {manifest.get('input_bytes', 0):,} "
                          "bytes)")
    if len(shards) == 1:
        return [str(shards[0][0])]
    weights = {c["name"]: c["weight"] for c in manifest["corpora"]}
    corpus_tokens: dict[str, int] = {}
    for _, shard in shards:
        corpus_tokens[shard["corpus"]] = corpus_tokens.get(shard["corpus"], 0) + shard["tokens"]
    total_weight = sum(weights[c] for c in corpus_tokens)
    out: list = []
    for prefix, shard in shards:
        out += [repr(weights[shard["corpus"]] / total_weight * shard["tokens"] / corpus_tokens[shard["corpus"]]),
                str(prefix)]
    return out


# What PaddleNLP's sample index costs (measured: docs/data.md), for the size check before it is built: its doc index
# is every item once per epoch (int32 positions: at most 2**31 - 1 entries; built through an int64 np.mgrid pair),
# its sample index two int32 per sample, its shuffle index one uint32 per sample. The seed's shape (100B tokens,
# 1 epoch, 24.4M samples) built in 7.3 s, 373 MB of files.
INDEX_BUILD_SAMPLES_PER_S = 2.5e6  # (conservative: 3.3M/s measured on 2 cores)
INDEX_MAX_SECONDS = 1800


def index_size(train_tokens: int, items: int, seq_length: int, samples: int, blended: bool = True) -> dict:
    """How big PaddleNLP's index of `samples` samples of a split of `train_tokens` tokens in `items` items is."""
    per_epoch = max((train_tokens - 1) // seq_length, 1)
    epochs = -(-int(samples * (1.005 if blended else 1)) // per_epoch)  # (blending asks each shard for 0.5% more)
    doc_entries, sample_rows = epochs * items, epochs * per_epoch
    return {"epochs": epochs, "doc_entries": doc_entries, "samples": sample_rows,
            "file_bytes": 4 * doc_entries + 8 * (sample_rows + 1) + 4 * sample_rows,
            "peak_bytes": 20 * doc_entries + 12 * sample_rows,
            "seconds": sample_rows / INDEX_BUILD_SAMPLES_PER_S}


def check_index(size: dict, steps: int, memory_bytes: int) -> None:
    """Refuse, in one line with the numbers, a step count whose index cannot be built (int32 positions, memory,
    time) -- before anything is built."""
    problems = []
    if size["doc_entries"] >= 2**31 - 1:
        problems.append(f"{size['doc_entries']:.3g} document-index entries (PaddleNLP's int32 index holds "
                        f"{2**31 - 1:.3g})")
    if size["peak_bytes"] > memory_bytes:
        problems.append(f"~{size['peak_bytes'] / 2**30:,.3g} GiB to build (this machine has {memory_bytes / 2**30:,.1f} "
                        "GiB available)")
    if size["seconds"] > INDEX_MAX_SECONDS:
        problems.append(f"~{size['seconds'] / 3600:,.3g} h to build")
    if problems:
        fits = max_steps_that_fit(size, steps, memory_bytes)
        raise ConfigError(f"training.max_steps={steps:,}: {size['epochs']:,} epochs of the corpus, "
                          f"{size['samples']:.3g} samples; its sample index needs " + " and ".join(problems)
                          + f": use at most training.max_steps={fits:,}, or more data")


def max_steps_that_fit(size: dict, steps: int, memory_bytes: int) -> int:
    """The largest step count whose index fits every bound, scaled from this one (the index grows linearly)."""
    scale = min((2**31 - 2) / max(size["doc_entries"], 1), memory_bytes / max(size["peak_bytes"], 1),
                INDEX_MAX_SECONDS / max(size["seconds"], 1e-9))
    return max(int(steps * scale * 0.95), 0)


def available_memory() -> int:
    """Half of what /proc/meminfo says is available (the launcher builds the index; the ranks start after)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 // 2
    except OSError:
        pass
    return 8 << 30


class Samples:
    """PaddleNLP's {"text": seq_length + 1 tokens} samples as the {"input_ids", "labels"} examples the Trainer feeds
    to the model (PaddleNLP's Llama criterion does not shift labels itself). The length is cut to a multiple of the
    global batch: the distributed sampler pads a length that its replicas do not divide, which would shuffle another
    list on another layout (training/rank.py make_trainer)."""

    def __init__(self, samples, multiple: int = 1):
        self.samples = samples
        self.length = len(samples) // multiple * multiple

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> dict:
        text = self.samples[i]["text"]
        return {"input_ids": text[:-1], "labels": text[1:]}


def train_dataset(run_data: Path, quiet: bool = False) -> Samples:
    """The training samples of a run (`run_data` = the run's data/ directory); builds the index files if missing."""
    spec = json.loads((run_data / RUN_DATA).read_text())
    path = Path(spec["path"])
    manifest = _manifest(path)
    from paddlenlp.data.causal_dataset import build_train_valid_test_datasets

    with _stdout_to(run_data / INDEX_DIR / "build.log") if quiet else contextlib.nullcontext():
        train, _, _ = build_train_valid_test_datasets(
            train_prefixes(path, manifest), "mmap", "1,0,0", [spec["train_samples"], 0, 0], spec["seq_length"],
            spec["seed"], True, share_folder=True, data_cache_path=str(run_data / INDEX_DIR))
    return Samples(train, spec.get("global_batch", 1))


@contextlib.contextmanager
def _stdout_to(path: Path):
    """PaddleNLP prints a page of statistics per shard, partly from its C++ helper: file descriptor 1 goes to a log
    file meanwhile."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    saved = os.dup(1)
    with open(path, "a") as log:
        os.dup2(log.fileno(), 1)
        try:
            yield
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)


def _manifest(path: Path) -> dict:
    try:
        return dataset.load_manifest(path)
    except ConfigError as exc:
        raise ConfigError(f"{exc} (on a cluster, data.cache_dir must be on storage every node shares)") from None


def split_blocks(path: Path, manifest: dict, split: str, seq_length: int,
                 max_blocks: int | None = None) -> np.ndarray:
    """A split's tokens in manifest order, cut into blocks of seq_length + 1 tokens (the rest dropped), at most
    `max_blocks` of them: only those tokens are read."""
    width = seq_length + 1
    need = None if max_blocks is None else max_blocks * width
    dtype = np.dtype(manifest["tokenizer"]["dtype"])
    parts, have = [], 0
    for prefix, _ in dataset.shard_prefixes(path, manifest, split):
        stream = dataset.tokens(prefix, dtype)
        take = stream if need is None else stream[: need - have]
        parts.append(np.asarray(take, dtype=np.int64))
        have += len(take)
        if need is not None and have >= need:
            break
    stream = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    n = len(stream) // width
    return stream[: n * width].reshape(n, width)


def validation_blocks(path: Path, manifest: dict, seq_length: int, max_blocks: int | None = None) -> np.ndarray:
    """The validation split in order, cut into blocks (each token once: a fixed held-out set)."""
    return split_blocks(path, manifest, "validation", seq_length, max_blocks)


class BlockDataset:
    """Packed blocks as the {"input_ids", "labels"} examples PaddleNLP's Trainer feeds to the model."""

    def __init__(self, blocks: np.ndarray):
        self.blocks = blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict:
        block = self.blocks[i]
        return {"input_ids": block[:-1], "labels": block[1:]}


def validation_dataset(run_data: Path) -> BlockDataset:
    spec = json.loads((run_data / RUN_DATA).read_text())
    path = Path(spec["path"])
    return BlockDataset(validation_blocks(path, _manifest(path), spec["seq_length"], spec["validation_blocks"]))


def corpus_blocks(run_data: Path) -> int:
    """Blocks of seq_length + 1 tokens in the training split (what "an epoch" is on the console)."""
    return json.loads((run_data / "stats.json").read_text())["train_blocks"]
