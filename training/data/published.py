"""Prepared data sets in the object store (`data.cache_dir=store`: under `<storage.uri>/data`, docs/storage.md).

A set is found or made on local disk as always, under `data.local_dir`, and published to the store by its content
key: every file first, its manifest last and only if absent (core/storage.py put_if_absent). A reader that finds
the manifest finds the whole set, and of two machines publishing one key one wins (the same bytes either way).
A machine that lacks a set fetches it once from the store into a staging directory renamed into place (core/dataset.py
publish), and reads it memory-mapped from local disk as from any cache.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from core import dataset
from core.files import DATA_CACHE, cache_path
from core.storage import Store, retrying


STORE = "store"  # (data.cache_dir's value for "in the object store storage.uri names")


def in_store(config) -> bool:
    return config.data.cache_dir == STORE


def store_uri(config) -> str:
    return f"{config.storage.uri.rstrip('/')}/data"


def local_root(config) -> Path:
    """Where this machine keeps its copies of the store's sets."""
    return cache_path(config.data.local_dir or DATA_CACHE)


def open_store(config):
    return Store.of(config.storage, store_uri(config))


def manifest(store, key: str) -> dict | None:
    """The manifest of the set `key` if the store has the whole set."""
    data = retrying(lambda: store.read(store.key(key, dataset.MANIFEST)), f"reading data set {key}", store)
    return json.loads(data) if data is not None else None


def fetch(store, key: str, root: Path, log=print) -> bool:
    """The set `key` from the store into `root`/`key`; False if the store does not have it (whole)."""
    if manifest(store, key) is None:
        return False
    began = time.time()
    staging = root / f".fetching-{key}-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    size = sum(f.stat().st_size for f in retrying(lambda: store.download(store.key(key), staging),
                                                  f"fetching data set {key}", store))
    dataset.publish(staging, root / key)
    log(f"data: fetched {key} from {store.uri} ({size / 2**20:.1f} MB in {time.time() - began:.1f}s)")
    return True


def publish(store, final: Path, key: str, log=print) -> None:
    """The local set `final` into the store under `key`, unless the store has it already; the manifest last."""
    if manifest(store, key) is not None:
        return
    began = time.time()

    def upload() -> tuple[int, bool]:
        store.ensure_bucket()
        size = store.upload_tree(final, store.key(key), lambda relative: relative == dataset.MANIFEST)
        return size, store.put_if_absent(store.key(key, dataset.MANIFEST), (final / dataset.MANIFEST).read_bytes())

    size, published = retrying(upload, f"publishing data set {key}", store)
    if published:
        log(f"data: published {key} to {store.uri} ({size / 2**20:.1f} MB in {time.time() - began:.1f}s)")
