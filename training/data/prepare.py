"""`make data`: corpus files -> a prepared data set (core/dataset.py), addressed by content and published by rename.

    key      a hash of the corpus bytes, every setting that shapes the result and this code: a second run, or another
             node that sees the same directory, reuses the set
    pieces   a big file cut into pieces of data.shard_mb, small (and compressed) files grouped into pieces of up
             to it: the shards follow the corpus's size, not its file count
    count    (data.max_documents only) documents per piece, so "the first N documents" is known per piece
    vocab    character counts of the training documents, summed over pieces -> the frozen vocabulary (or the
             tokenizer of tokenizer.path, used as it is)
    shard    every piece tokenized into its own train/validation shard pair
    publish  manifest.json written, the staging directory renamed into place

The three passes run as tasks of one worker function (training/data/shards.py) on an engine: local processes (one per
core by default) or Ray tasks. Each task's result is kept in the staging directory, so after a kill the next
`make data` continues where it stopped; a lock keeps two preparations of the same key from writing at once.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import string
import time
import unicodedata
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from importlib.metadata import version

from core import REPO_ROOT, dataset
from core.errors import ConfigError
from core.tokenizer import (EOS_TOKEN, HF_FILES, SPECIAL_TOKENS, TOKENIZER_JSON, HFTokenizer, is_hf_tokenizer, read_vocab,
                            train_bpe, write_tokenizer)
from core.files import atomic_write, cache_path
from training.data import corpus, engines, published

CODE = [Path(__file__).parent / name for name in ("corpus.py", "shards.py", "prepare.py")] + \
       [REPO_ROOT / "core" / "dataset.py", REPO_ROOT / "core" / "tokenizer.py"]


@dataclass
class Prepared:
    path: Path
    manifest: dict
    reused: bool
    seconds: float


def data_root(config, run_dir: Path | None = None) -> Path:
    """Where data sets are kept on this machine: data.cache_dir, data.local_dir when the cache is an object store
    (training/data/published.py), or the run directory's data/ when caching is off."""
    if published.in_store(config):
        return published.local_root(config)
    if config.data.cache_dir:
        return cache_path(config.data.cache_dir)
    if run_dir is None:
        raise ConfigError("data.cache_dir is empty (prepare inside each run): `make data` needs a data.cache_dir")
    return run_dir / "data"


def content_key(config, corpora: list[corpus.Corpus]) -> str:
    d, t = config.data, config.tokenizer
    key = hashlib.sha256(json.dumps({
        # (a file counts by its bytes, in order, and its kind, never by its path: the same corpus on another
        # machine, or in another clone, is the same set)
        "corpora": [{"name": c.name, "weight": c.weight, "files": ["".join(p.suffixes[-2:]) for p in c.files]}
                    for c in corpora],
        "text_field": d.text_field, "validation_fraction": d.validation_fraction, "max_documents": d.max_documents,
        "split_seed": d.split_seed, "shard_mb": d.shard_mb,
        "tokenizer": None if t.path else {"min_frequency": t.min_frequency, "max_vocab_size": t.max_vocab_size}
        if t.kind == "chars" else {"kind": t.kind, "vocab_size": t.vocab_size, "train_mb": t.train_mb},
        "tokenizers": version("tokenizers"), "format": dataset.FORMAT_VERSION}, sort_keys=True).encode())
    for source in CODE:
        key.update(source.read_bytes())
    if t.path:
        for name in ("vocab.txt", "tokenizer_config.json", TOKENIZER_JSON):
            if (Path(t.path) / name).is_file():
                key.update((Path(t.path) / name).read_bytes())
    for c in corpora:
        for path in c.files:
            key.update(_file_digest(path))
    return key.hexdigest()[:32]


_DIGESTS: dict[tuple, bytes] = {}


def _file_digest(path: Path) -> bytes:
    """sha256 of a corpus file, read once per process while the file is unchanged (the launcher's size check and
    its preparation both need the content key: a 100 GB corpus is not read twice)."""
    stat = path.stat()
    known = (str(path), stat.st_size, stat.st_mtime_ns)
    if known not in _DIGESTS:
        with open(path, "rb") as f:
            _DIGESTS[known] = hashlib.file_digest(f, "sha256").digest()
    return _DIGESTS[known]


def prepare(config, run_dir: Path | None = None, log=print) -> Prepared:
    """The prepared data set of `config`: found by its key, or made (and published) now."""
    t0 = time.time()
    corpora = corpus.corpora(config.data)
    _check_tokenizer_path(config.tokenizer.path)
    root = data_root(config, run_dir)
    key = content_key(config, corpora)
    final = root / key
    remote = published.open_store(config) if published.in_store(config) else None
    if (final / dataset.MANIFEST).is_file():
        if remote is not None:
            published.publish(remote, final, key, log)  # (made here before the store was configured)
        return Prepared(final, dataset.check(final), True, time.time() - t0)
    root.mkdir(parents=True, exist_ok=True)
    staging = root / f".staging-{key}"
    # (the lock file stays: unlinked after a turn, a preparation waiting on it holds a lock on a file that is gone,
    # and the next one creates a new file and locks that one, so the two build the same key at once)
    with open(root / f".staging-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # (a concurrent preparation of the same key: wait, then reuse its set)
        reused = (final / dataset.MANIFEST).is_file() or (remote is not None and published.fetch(remote, key, root, log))
        if not reused:
            if staging.exists():
                log(f"data: continuing the interrupted preparation in {staging}")
            manifest = _build(config, corpora, staging, key, log)
            dataset.publish(staging, final)
    if reused:
        return Prepared(final, dataset.check(final), True, time.time() - t0)
    if remote is not None:
        published.publish(remote, final, key, log)
    manifest["prepare_seconds"] = round(time.time() - t0, 2)
    return Prepared(final, manifest, False, time.time() - t0)


def find_prepared(config) -> dict | None:
    """The manifest of the config's prepared set if it is in data.cache_dir already (nothing is prepared)."""
    if not config.data.cache_dir:
        return None
    key = content_key(config, corpus.corpora(config.data))
    path = data_root(config) / key / dataset.MANIFEST
    if path.is_file():
        return json.loads(path.read_text())
    return published.manifest(published.open_store(config), key) if published.in_store(config) else None


def _check_tokenizer_path(path: str) -> None:
    if path and not any((Path(path).expanduser() / name).is_file() for name in ("vocab.txt", TOKENIZER_JSON)):
        raise ConfigError(f"tokenizer.path: {path} has neither vocab.txt (a PaddleNLP tokenizer directory, e.g. a "
                          f"run's or an export's tokenizer/) nor {TOKENIZER_JSON} (a Hugging Face model's tokenizer)")


def _build(config, corpora: list[corpus.Corpus], staging: Path, key: str, log) -> dict:
    d = config.data
    pieces = corpus.pieces(corpora, shard_bytes(d.shard_mb, corpora))
    engine = engines.make(d.engine, d.workers, d.ray_address)
    try:
        return _passes(config, corpora, pieces, engine, staging, key, log)
    finally:
        engine.close()


def _passes(config, corpora, pieces, engine, staging: Path, key: str, log) -> dict:
    d = config.data
    common = {"staging": str(staging), "text_field": d.text_field, "seed": d.split_seed,
              "validation_fraction": d.validation_fraction}
    limits = _limits(engine, pieces, common, d.max_documents, log) if d.max_documents else {}
    tasks = lambda kind, extra: [  # noqa: E731
        {**common, **extra, "kind": kind, "piece": asdict(p), "limit": limits.get(p.name)} for p in pieces
        if limits.get(p.name, 1) > 0]
    tokenizer_dir = staging / dataset.TOKENIZER_DIR
    if not dataset.has_tokenizer(staging) and not config.tokenizer.path and config.tokenizer.kind == "bpe":
        log(f"data: learning a byte-level BPE of {config.tokenizer.vocab_size} tokens from the training split")
        tmp = tokenizer_dir.with_name(tokenizer_dir.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        train_bpe(training_texts(config, pieces, limits), config.tokenizer.vocab_size, tmp)
        os.replace(tmp, tokenizer_dir)
    if not dataset.has_tokenizer(staging):
        counts = None
        if not config.tokenizer.path:
            counts = Counter()
            for result in engine.run(tasks("vocab", {}), "vocabulary", log):
                counts.update(result["counts"])
        _freeze_tokenizer(config.tokenizer, counts, tokenizer_dir)
    size, eos_id, unk_id = _special_ids(config, tokenizer_dir)
    extra = {"eos_id": eos_id, "unk_id": unk_id, "dtype": dataset.token_dtype(size).name}
    results = engine.run(tasks("shard", extra), "tokenize", log)
    manifest = _manifest(config, corpora, pieces, results, key, size, extra, engine)
    atomic_write(staging / dataset.MANIFEST, json.dumps(manifest, indent=1))
    shutil.rmtree(staging / "parts", ignore_errors=True)
    return manifest


def shard_bytes(shard_mb: int, corpora: list[corpus.Corpus]) -> int:
    """data.shard_mb, or (0) the corpus / 64 within 1..1024 MB: a function of the corpus alone, so the shards (and
    the content key) do not depend on the workers."""
    if shard_mb:
        return shard_mb << 20
    total = sum(path.stat().st_size for c in corpora for path in c.files)
    return min(max(total // 64, 1 << 20), 1 << 30)


def _limits(engine, pieces: list[corpus.Piece], common: dict, max_documents: int, log) -> dict[str, int]:
    """data.max_documents: how many documents each piece contributes to "the first N of the corpus"."""
    results = engine.run([{**common, "kind": "count", "piece": asdict(p)} for p in pieces], "count", log)
    counts = {r["piece"]: r["documents"] for r in results}
    left, limits = max_documents, {}
    for p in pieces:
        limits[p.name] = min(left, counts[p.name])
        left -= limits[p.name]
    return limits


def _is_cjk(ch: str) -> bool:
    cp = ord(ch)
    return 0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0xF900 <= cp <= 0xFAFF or 0x20000 <= cp <= 0x2FA1F


# Characters every vocabulary has, after the corpus's own: JSON, tool calls and code can always be written
# (structured output, serving/engine/constraints.py: a corpus of reviews may have no "{")
ASCII = string.ascii_lowercase + string.digits + string.punctuation


def _forms(ch: str) -> list[str]:
    return [ch] if _is_cjk(ch) or unicodedata.category(ch).startswith("P") else [ch, "##" + ch]


def build_vocabulary(counts: Counter, config) -> list[str]:
    """Characters of the training split by frequency (ties by character: the same vocabulary whatever the pieces and
    workers), then the ASCII letters, digits and punctuation it lacks. ErnieTokenizer lower-cases and strips
    accents, splits CJK characters and punctuation into single tokens, and word-pieces other runs (letters, digits),
    so every non-CJK character also gets its `##` form."""
    vocab = list(SPECIAL_TOKENS)
    kept = [ch for ch, n in sorted(counts.items(), key=lambda item: (-item[1], item[0]))
            if n >= config.min_frequency and not ch.isspace() and unicodedata.category(ch) not in ("Mn", "Cc", "Cf")]
    room = config.max_vocab_size - sum(len(_forms(ch)) for ch in ASCII)
    for ch in kept:
        if len(vocab) + len(_forms(ch)) > room:
            break
        vocab.extend(_forms(ch))
    known = set(vocab)
    return vocab + [form for ch in ASCII if ch not in known for form in _forms(ch)]


def training_texts(config, pieces: list[corpus.Piece], limits: dict | None = None):
    """The training split's documents in corpus order (data.max_documents' per-piece `limits`), up to
    tokenizer.train_mb of text: what a BPE learns from."""
    is_validation = corpus.split_rule(config.data.split_seed, config.data.validation_fraction)
    budget = config.tokenizer.train_mb << 20
    for piece in pieces:
        for doc in corpus.documents(piece, config.data.text_field, (limits or {}).get(piece.name)):
            if budget <= 0:
                return
            if not is_validation(doc):
                budget -= len(doc.encode("utf-8"))
                yield doc


def _special_ids(config, tokenizer_dir: Path) -> tuple[int, int, int]:
    """(vocabulary size, the id documents end with, the unknown token's id or -1: byte-level BPE has none)."""
    if is_hf_tokenizer(tokenizer_dir):
        tok = HFTokenizer(tokenizer_dir)
        return len(tok), tok.eos_token_id, -1 if tok.unk_token_id is None else tok.unk_token_id
    vocab = read_vocab(tokenizer_dir)
    ids = {token: i for i, token in enumerate(vocab)}
    for needed in (EOS_TOKEN, "[UNK]"):
        if needed not in ids:
            raise ConfigError(f"tokenizer.path: {config.tokenizer.path} has no {needed} token (documents end with "
                              f"{EOS_TOKEN}; unknown characters map to [UNK])")
    return len(vocab), ids[EOS_TOKEN], ids["[UNK]"]


def _freeze_tokenizer(config, counts: Counter | None, directory: Path) -> None:
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    if counts is None:
        source = Path(config.path).expanduser()
        tmp.mkdir(parents=True)
        for name in ("vocab.txt", *HF_FILES):
            if (source / name).is_file():
                shutil.copy2(source / name, tmp / name)
    else:
        if not counts:
            raise ConfigError("the corpus is empty: no non-blank documents in its training split")
        write_tokenizer(build_vocabulary(counts, config), tmp)
    os.replace(tmp, directory)


def _manifest(config, corpora, pieces, results, key, vocab_size, extra, engine) -> dict:
    by_piece = {r["piece"]: r for r in results}
    shards, totals = [], {split: {"documents": 0, "tokens": 0, "chars": 0} for split in dataset.SPLITS}
    unknown = 0
    for p in pieces:
        r = by_piece.get(p.name)
        for split in dataset.SPLITS if r else ():
            shards.append({"name": p.name, "corpus": p.corpus, "split": split, "files": len(p.segments),
                           "source": p.segments[0].path, "start": p.segments[0].start, **r[split]})
            totals[split]["documents"] += r[split]["documents"]
            totals[split]["tokens"] += r[split]["tokens"]
            totals[split]["chars"] += r[split].get("chars", 0)
        unknown += r["validation"]["unknown"] if r else 0
    for split, total in totals.items():
        if total["documents"] == 0:
            raise ConfigError(f"the corpus is too small for a train/validation split at data.validation_fraction="
                              f"{config.data.validation_fraction}: the {split} split has no documents; add documents "
                              f"or change the fraction")
    return {
        "format": dataset.FORMAT_VERSION, "key": key, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "corpora": [{"name": c.name, "weight": c.weight, "files": [str(f) for f in c.files]} for c in corpora],
        "tokenizer": {"vocab_size": vocab_size, "eos_id": extra["eos_id"], "unk_id": extra["unk_id"],
                      "dtype": extra["dtype"], "source": config.tokenizer.path or "built from the training split"},
        "settings": {k: v for k, v in asdict(config.data).items() if k not in ("cache_dir", "local_dir", "workers",
                                                                                 "engine", "ray_address")},
        "shards": shards, "totals": totals,
        "validation_unknown_rate": unknown / max(totals["validation"]["tokens"], 1),
        "input_bytes": sum(p.size for p in pieces), "engine": engine.describe(),
    }
