"""The prepared data set: the contract between `make data` (training/data/prepare.py writes it) and its readers
(training ranks, evaluation). Token files are PaddleNLP's (and Megatron-LM's) memory-mapped indexed format, so
`paddlenlp.data.indexed_dataset.MMapIndexedDataset` and `causal_dataset.build_train_valid_test_datasets` read them.

    <data.cache_dir>/<key>/           key: a hash of the corpus bytes, the settings and the code (content address)
        manifest.json                 sources and blend weights, every shard with its documents/tokens/bytes, totals
        tokenizer/                    core/tokenizer.py format (vocab.txt + ErnieTokenizer config)
        train/<shard>.bin + .idx      one pair per input piece: documents of the training split, each followed by
        validation/<shard>.bin + .idx the end-of-document token; the validation split, by the per-document rule.
                                      Index entries ("items") are runs of consecutive whole documents (up to
                                      training/data/shards.py ITEM_TOKENS): what PaddleNLP's dataset shuffles

A set is built in `.staging-<key>/` and renamed into place once complete, so a reader never sees half of one.

Why this module writes `.idx` itself instead of PaddleNLP's `MMapIndexedDatasetBuilder`: the builder's module
imports paddle (~1.5 s and ~250 MB in every preparation worker) and keeps the sizes in Python lists; the bytes written
here are the same (tests/unit/test_data.py reads them back with PaddleNLP's reader).
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np

from core.errors import ConfigError

MANIFEST = "manifest.json"
TOKENIZER_DIR = "tokenizer"
SPLITS = ("train", "validation")
FORMAT_VERSION = 1

# PaddleNLP indexed_dataset.py: magic, version 1, dtype codes (shared with Megatron-LM).
IDX_MAGIC = b"MMIDIDX\x00\x00"
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
               8: np.uint16}
CODE_OF = {np.dtype(v): k for k, v in DTYPE_CODES.items()}
HEADER_BYTES = 9 + 8 + 1 + 8 + 8


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 while the vocabulary fits (PaddleNLP's own rule: below 65,500), else int32."""
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


def write_index(path: Path, sizes: np.ndarray, dtype: np.dtype) -> None:
    """The `.idx` of a `.bin` holding items of `sizes` tokens each, one item per index document (PaddleNLP's
    `MMapIndexedDataset.Index.writer`: header, int32 sizes, int64 byte pointers, int64 document index)."""
    sizes = np.asarray(sizes, dtype=np.int32)
    pointers = np.zeros(len(sizes), dtype=np.int64)
    if len(sizes) > 1:
        np.cumsum(sizes[:-1].astype(np.int64) * np.dtype(dtype).itemsize, out=pointers[1:])
    doc_idx = np.arange(len(sizes) + 1, dtype=np.int64)
    with open(path, "wb") as f:
        f.write(IDX_MAGIC + struct.pack("<Q", 1) + struct.pack("<B", CODE_OF[np.dtype(dtype)]))
        f.write(struct.pack("<Q", len(sizes)) + struct.pack("<Q", len(doc_idx)))
        f.write(sizes.tobytes(order="C"))
        f.write(pointers.tobytes(order="C"))
        f.write(doc_idx.tobytes(order="C"))


def read_index(prefix: Path | str) -> tuple[np.dtype, np.ndarray]:
    """(token dtype, document sizes) of a shard, checked against its `.bin`: a damaged or truncated pair is a
    ConfigError naming the file."""
    idx, bin_ = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    try:
        raw = idx.read_bytes()
        bin_bytes = bin_.stat().st_size
    except OSError as exc:
        raise ConfigError(f"prepared data is damaged: {exc.filename} cannot be read ({exc.strerror}); delete the "
                          f"data set's directory and run `make data` again") from None
    if len(raw) < HEADER_BYTES or raw[:9] != IDX_MAGIC or struct.unpack("<Q", raw[9:17])[0] != 1:
        raise _damaged(idx, "not a version-1 mmap index (bad header)")
    code = raw[17]
    if code not in DTYPE_CODES:
        raise _damaged(idx, f"unknown token type code {code}")
    dtype = np.dtype(DTYPE_CODES[code])
    n, docs = struct.unpack("<QQ", raw[18:34])
    if len(raw) != HEADER_BYTES + n * 4 + n * 8 + docs * 8:
        raise _damaged(idx, f"{len(raw)} bytes, expected {HEADER_BYTES + n * 20 + docs * 8} for {n} documents")
    sizes = np.frombuffer(raw, dtype=np.int32, count=n, offset=HEADER_BYTES)
    expected = int(sizes.astype(np.int64).sum()) * dtype.itemsize
    if bin_bytes != expected:
        raise _damaged(bin_, f"{bin_bytes} bytes, its index says {expected}")
    return dtype, sizes


def _damaged(path: Path, why: str) -> ConfigError:
    return ConfigError(f"prepared data is damaged: {path}: {why}; delete the data set's directory and run "
                       f"`make data` again")


def tokens(prefix: Path | str, dtype: np.dtype) -> np.ndarray:
    """A shard's token stream, memory-mapped (nothing is read until used)."""
    path = Path(f"{prefix}.bin")
    if path.stat().st_size == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")


def load_manifest(directory: Path | str) -> dict:
    path = Path(directory) / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raise ConfigError(f"{directory} is not a prepared data set (no readable {MANIFEST}); run `make data`") \
            from None
    if manifest.get("format") != FORMAT_VERSION:
        raise ConfigError(f"{path}: data set format {manifest.get('format')} is not {FORMAT_VERSION}; prepare it "
                          f"again with `make data`")
    return manifest


def shard_prefixes(directory: Path | str, manifest: dict, split: str) -> list[tuple[Path, dict]]:
    """(prefix, shard record) of every non-empty shard of `split`, in manifest order."""
    return [(Path(directory) / split / shard["name"], shard) for shard in manifest["shards"]
            if shard["split"] == split and shard["documents"] > 0]


def check(directory: Path | str) -> dict:
    """The manifest of a complete, undamaged data set; every shard's index and size are checked (cheap: the index
    only, never the tokens). A damaged file is a one-line ConfigError naming it."""
    manifest = load_manifest(directory)
    for split in SPLITS:
        for prefix, shard in shard_prefixes(directory, manifest, split):
            _, sizes = read_index(prefix)
            if len(sizes) != shard["items"] or int(sizes.astype(np.int64).sum()) != shard["tokens"]:
                raise _damaged(Path(f"{prefix}.idx"), f"{len(sizes)} items / {int(sizes.sum())} tokens, the "
                                                      f"manifest says {shard['items']} / {shard['tokens']}")
    if not has_tokenizer(directory):
        raise _damaged(Path(directory) / TOKENIZER_DIR / "vocab.txt", "missing")
    return manifest


def has_tokenizer(directory: Path) -> bool:
    """A data set's tokenizer is there: this project's vocabulary (vocab.txt) or a model's own (tokenizer.json)."""
    return any((Path(directory) / TOKENIZER_DIR / name).is_file() for name in ("vocab.txt", "tokenizer.json"))


def publish(staging: Path, final: Path) -> None:
    """Rename a complete staging directory into place (atomic on one file system); a set published meanwhile by a
    concurrent preparation of the same key wins, and this one is dropped."""
    try:
        os.rename(staging, final)
    except OSError:
        if not (final / MANIFEST).is_file():
            raise
        import shutil

        shutil.rmtree(staging, ignore_errors=True)
