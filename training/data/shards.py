"""The per-piece worker of `make data`: one function, `run(task)`, that a local process pool and Ray tasks call the
same way. It reads one piece of the corpus and writes its result into the staging directory, each file renamed into
place once complete and the result's JSON last, so a killed preparation resumes where it stopped and nothing
half-written is ever read. Memory is bounded by the piece, never by the corpus.

Kinds of task:
    count   documents in the piece (only with data.max_documents: which documents are "the first N")
    vocab   character counts of the piece's training documents (the vocabulary is built from their sum)
    shard   the piece's documents tokenized into train/<piece>.bin/.idx and validation/<piece>.bin/.idx
"""
from __future__ import annotations

import json
import os
import time
import unicodedata
from array import array
from collections import Counter
from pathlib import Path
import itertools
import numpy as np

from core.files import atomic_write
from core import dataset
from core import tokenizer as tokenizer_format
from core.files import fsync_path, publish
from core.tokenizer import chunks
from training.data.corpus import Piece, documents, split_rule

BATCH_DOCUMENTS = 512  # documents tokenized per call (the Rust tokenizer's per-call overhead amortised) ...
BATCH_CHARS = 1 << 18  # ... or fewer, once they hold this many characters (its memory grows with the call's text)


def single_threaded() -> None:
    """One core per worker: the Rust tokenizer would otherwise start a thread per core in every worker."""
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def result_path(staging: Path, kind: str, piece_name: str) -> Path:
    return staging / "parts" / f"{piece_name}.{kind}.json"


def run(task: dict) -> dict:
    """Do one task (or return the result an earlier, interrupted preparation already wrote)."""
    single_threaded()

    staging, piece, kind = Path(task["staging"]), Piece(**task["piece"]), task["kind"]
    done = result_path(staging, kind, piece.name)
    if done.is_file():
        return json.loads(done.read_text())
    t0 = time.time()
    result = {"count": _count, "vocab": _vocab, "shard": _shard}[kind](task, staging, piece)
    result.update(piece=piece.name, kind=kind, seconds=round(time.time() - t0, 3), bytes=piece.size)
    done.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(done, json.dumps(result))
    return result


def _docs(task: dict, piece):
    return documents(piece, task["text_field"], task.get("limit"))


def _count(task: dict, staging: Path, piece) -> dict:
    return {"documents": sum(1 for _ in _docs(task, piece))}


def _vocab(task: dict, staging: Path, piece) -> dict:
    """Character counts of the training documents, lower-cased and NFD-decomposed as ErnieTokenizer sees them."""
    is_validation = split_rule(task["seed"], task["validation_fraction"])
    counts: Counter = Counter()
    for doc in _docs(task, piece):
        if not is_validation(doc):
            counts.update(unicodedata.normalize("NFD", doc.lower()))
    return {"counts": dict(counts)}


def _shard(task: dict, staging: Path, piece) -> dict:
    tokenizer = tokenizer_format.fast_tokenizer(staging / dataset.TOKENIZER_DIR)
    eos, unk, dtype = task["eos_id"], task["unk_id"], np.dtype(task["dtype"])
    is_validation = split_rule(task["seed"], task["validation_fraction"])
    writers = {split: _ShardWriter(staging / split / piece.name, dtype) for split in dataset.SPLITS}
    batch: dict[str, list[str]] = {split: [] for split in dataset.SPLITS}
    unknown, chars = dict.fromkeys(dataset.SPLITS, 0), dict.fromkeys(dataset.SPLITS, 0)
    text_chars = dict.fromkeys(dataset.SPLITS, 0)  # (the split's characters: bits per character from a loss)

    def flush(split: str) -> None:
        if batch[split]:
            ids = [e.ids for e in tokenizer.encode_batch(batch[split], add_special_tokens=False)]
            batch[split].clear()
            chars[split] = 0
            unknown[split] += writers[split].add(ids, eos, unk)

    long_chars = tokenizer_format.CHUNK_CHARS
    for doc in _docs(task, piece):
        split = "validation" if is_validation(doc) else "train"
        text_chars[split] += len(doc)
        if len(doc) > long_chars:  # (in order: what is batched first, then the long document chunk by chunk)
            flush(split)
            unknown[split] += _add_long(tokenizer, doc, writers[split], min(long_chars, tokenizer_format.PART_CHARS),
                                        eos, unk)
            continue
        batch[split].append(doc)
        chars[split] += len(doc)
        if len(batch[split]) >= BATCH_DOCUMENTS or chars[split] >= BATCH_CHARS:
            flush(split)
    for split in dataset.SPLITS:
        flush(split)
    return {split: writers[split].finish() | {"unknown": unknown[split], "chars": text_chars[split]}
            for split in dataset.SPLITS}


def _add_long(tokenizer, doc: str, writer: "_ShardWriter", part_chars: int, eos: int, unk: int) -> int:
    """A long document in chunks cut where no token spans them (core/tokenizer.py chunks): the same ids as whole."""
    unknown, parts = 0, chunks(doc, part_chars)
    while group := list(itertools.islice(parts, BATCH_CHARS // part_chars)):
        for encoding in tokenizer.encode_batch(group, add_special_tokens=False):
            unknown += writer.add_part(encoding.ids, unk)
    return unknown + writer.add([[]], eos, unk)  # (its end token)


# Index entries ("items", what PaddleNLP's causal dataset shuffles) are runs of consecutive whole documents of up to
# this many tokens, not single documents: neighbouring documents of a corpus are related text (the previous packed
# data kept them together), and with one short review per item the default run ended at a higher eval_loss
# (docs/data.md has the figures). Fewer, larger items also keep the index arrays small for corpora of billions of
# short documents. A longer document is an item of its own; none is ever cut.
ITEM_TOKENS = 4096


class _ShardWriter:
    """One `.bin` written as documents arrive, its `.idx` at the end; both renamed into place when complete."""

    def __init__(self, prefix: Path, dtype):
        prefix.parent.mkdir(parents=True, exist_ok=True)
        self.prefix, self.dtype = prefix, dtype
        self.tmp_bin = Path(f"{prefix}.bin.tmp")
        self.file = open(self.tmp_bin, "wb")
        self.sizes = array("i")  # tokens of each item
        self.open_item, self.documents, self.part_tokens = 0, 0, 0

    def add(self, docs: list[list[int]], eos: int, unk: int) -> int:
        """Append documents (each followed by the end-of-document token); returns how many tokens were unknown.
        A document written with `add_part` before is completed by the first of `docs` (its end token: [])."""
        for ids in docs:
            ids.append(eos)
            self._document(self.part_tokens + len(ids))
            self.part_tokens = 0
        self.documents += len(docs)
        flat = np.fromiter(itertools.chain.from_iterable(docs), dtype=self.dtype,
                           count=sum(len(ids) for ids in docs))
        self.file.write(flat.tobytes())
        return int((flat == unk).sum())

    def add_part(self, ids: list[int], unk: int) -> int:
        """Append part of a long document (training/data/shards.py chunks it); its item is decided at its end."""
        flat = np.asarray(ids, dtype=self.dtype)
        self.file.write(flat.tobytes())
        self.part_tokens += len(ids)
        return int((flat == unk).sum())

    def _document(self, tokens: int) -> None:
        if self.open_item and self.open_item + tokens > ITEM_TOKENS:
            self.sizes.append(self.open_item)
            self.open_item = 0
        self.open_item += tokens

    def finish(self) -> dict:
        if self.open_item:
            self.sizes.append(self.open_item)
            self.open_item = 0
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        sizes = np.frombuffer(self.sizes, dtype=np.int32) if len(self.sizes) else np.zeros(0, dtype=np.int32)
        tmp_idx = Path(f"{self.prefix}.idx.tmp")
        dataset.write_index(tmp_idx, sizes, self.dtype)
        fsync_path(tmp_idx)
        publish(self.tmp_bin, f"{self.prefix}.bin")
        publish(tmp_idx, f"{self.prefix}.idx")
        return {"documents": self.documents, "items": len(sizes), "tokens": int(sizes.astype(np.int64).sum()),
                "bin_bytes": int(sizes.astype(np.int64).sum()) * np.dtype(self.dtype).itemsize}


