"""Files that a reader or a crash may see half-done are written one way, here: a temporary file beside the target
(unique to the writing process and thread), written, flushed and fsynced, renamed over the target (atomic on one
file system), and the directory fsynced so that the rename itself survives a crash of the machine. And where this
tool keeps its per-user cache (`user_cache`, `cache_path`), decided once."""
from __future__ import annotations

import os
import threading
from pathlib import Path


def fsync_path(path: str | Path) -> None:
    """Make a file's contents, or a directory's entries, durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | Path, data: str | bytes, mode: int | None = None) -> None:
    """`path` holds either its old contents or all of `data`, never part of it, whatever stops the writer; `mode`:
    the file's permissions from its first byte (e.g. 0o600 for a secret)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") if mode is None else os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                                                                    mode), "wb") as fh:
            fh.write(data.encode("utf-8") if isinstance(data, str) else data)
            fh.flush()
            os.fsync(fh.fileno())
        publish(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def publish(written: str | Path, path: str | Path) -> None:
    """Rename a file written (and fsynced) elsewhere in the same directory over `path`, durably."""
    os.replace(written, path)
    fsync_path(Path(path).parent)


# data.cache_dir's default (and data.local_dir's when the sets live in the store), as a config writes it
DATA_CACHE = "~/.cache/paddle-train-to-serve/data"


def user_cache(*parts: str) -> Path:
    """This tool's per-user cache: $XDG_CACHE_HOME/paddle-train-to-serve when that is set (the XDG base-directory
    rule), else ~/.cache/paddle-train-to-serve; prepared data sets, the bench's server list, the peer environments."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base.joinpath("paddle-train-to-serve", *parts)


def cache_path(configured: str) -> Path:
    """A configured directory (data.cache_dir, data.local_dir), absolute: `~/.cache/...` (the defaults are written
    so) is read as $XDG_CACHE_HOME/... when that is set."""
    if configured.startswith("~/.cache/") and os.environ.get("XDG_CACHE_HOME"):
        return (Path(os.environ["XDG_CACHE_HOME"]) / configured[len("~/.cache/"):]).resolve()
    return Path(configured).expanduser().resolve()
