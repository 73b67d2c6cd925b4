"""The chat template (core/chat.py): one rendering for the server and PaddleNLP, and the fine-tuning examples'
loss mask (training/finetune/data.py)."""
import json

import numpy as np
import pytest

from core import chat
from core.config import ConfigError, load_config
from core.tokenizer import SPECIAL_TOKENS, fast_tokenizer, load_tokenizer, write_tokenizer
from training.finetune import data as sft

CONVERSATIONS = [
    [{"role": "user", "content": "你好"}],
    [{"role": "system", "content": "你是助手"}, {"role": "user", "content": "评论：很好"},
     {"role": "assistant", "content": "正面"}, {"role": "user", "content": "评论：很差"}],
    [{"role": "assistant", "content": "你好"}, {"role": "user", "content": "一"}, {"role": "user", "content": "二"}],
    [{"role": "system", "content": "甲"}, {"role": "system", "content": "乙"}, {"role": "user", "content": "abc 你好"}],
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tokenizer")
    chars = sorted(set("".join(m["content"] for c in CONVERSATIONS for m in c) + chat.USER + chat.ASSISTANT
                       + "评论这条的情感是正面还是负面？好差") - {" "})
    write_tokenizer(SPECIAL_TOKENS + chars + ["abc"], directory)
    chat.write(directory)
    return directory


def test_the_server_renders_what_paddlenlp_renders(tokenizer_dir):
    """core.chat.render (the API server, no PaddleNLP import) == the tokenizer's apply_chat_template, for a single
    question, a system + multi-turn conversation, one that starts with the assistant and repeated roles."""
    tokenizer = load_tokenizer(tokenizer_dir)
    assert tokenizer.chat_template is not None  # (PaddleNLP loaded chat_template.json with the tokenizer)
    rendered = []
    for messages in CONVERSATIONS:
        system, turns = chat.conversation(messages)
        ours = chat.render(chat.read(tokenizer_dir), system, turns)
        assert ours == tokenizer.apply_chat_template(turns, tokenize=False, context_data={"system": system})
        rendered.append(ours)
    assert rendered[0] == "用户：你好\n助手："
    assert rendered[1] == "你是助手\n用户：评论：很好\n助手：正面[SEP]用户：评论：很差\n助手："
    assert rendered[2] == "用户：\n助手：你好[SEP]用户：一\n二\n助手："
    assert rendered[3].startswith("甲\n乙\n用户：")


def test_conversations_that_cannot_be_answered_or_learned_are_refused():
    with pytest.raises(ConfigError, match="end with a user message"):
        chat.conversation([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    with pytest.raises(ConfigError, match="end with an assistant message"):
        chat.conversation([{"role": "user", "content": "a"}], answered=True)
    with pytest.raises(ConfigError, match="role 'tool'"):
        chat.conversation([{"role": "tool", "content": "a"}])
    assert chat.missing_characters(chat.TEMPLATE, SPECIAL_TOKENS + list("用户助")) == ["手", "："]


def paddlenlp_row(tokenizer, messages: list[dict], seq_length: int):
    """The reference: the row from PaddleNLP's own `encode_chat_inputs` (the tokenizer loaded the same template)."""
    system, turns = chat.conversation(messages, answered=True)
    encoded = tokenizer.encode_chat_inputs(turns, context_data={"system": system})
    return sft._row([encoded.get("system", [])] + [ids for turn in encoded["conversations"] for ids in turn],
                    tokenizer.pad_token_id, seq_length)


def test_examples_learn_the_answers_only(tokenizer_dir):
    """Inputs are ids[:-1], labels ids[1:] with -100 on the prompt (system, questions) and the padding; every answer
    and its end token is learned; the rows (core/chat.py's rendering, the fast tokenizer) equal those PaddleNLP's
    encode_chat_inputs gives."""
    tokenizer, fast = load_tokenizer(tokenizer_dir), fast_tokenizer(tokenizer_dir)
    template = chat.read(tokenizer_dir)
    messages = CONVERSATIONS[1][:3]  # system, question, answer 正面
    two_turns = [*CONVERSATIONS[1], {"role": "assistant", "content": "负面"}]
    no_system = [m for m in two_turns if m["role"] != "system"]
    rows = sft.encode_all(template, fast, tokenizer.pad_token_id, [messages, two_turns, no_system], 32)
    row = rows[0]
    ids = tokenizer.encode("你是助手\n用户：评论：很好\n助手：正面[SEP]", add_special_tokens=False)["input_ids"]
    assert list(row[0, :len(ids) - 1]) == ids[:-1] and (row[0, len(ids) - 1:] == tokenizer.pad_token_id).all()
    learned = [int(t) for t in row[1] if t != sft.IGNORE]
    assert tokenizer.convert_ids_to_tokens(learned) == ["正", "面", "[SEP]"]
    assert list(np.flatnonzero(row[1] != sft.IGNORE)) == [len(ids) - 4, len(ids) - 3, len(ids) - 2]
    for got, messages_ in zip(rows, [messages, two_turns, no_system]):
        assert np.array_equal(got, paddlenlp_row(tokenizer, messages_, 32))
    assert tokenizer.convert_ids_to_tokens([int(t) for t in rows[1][1] if t != sft.IGNORE]) == \
        ["正", "面", "[SEP]", "负", "面", "[SEP]"]
    assert sft.encode_all(template, fast, 0, [two_turns], 10) == [None]  # (longer than seq_length + 1: left out)


def test_instruction_data_shapes(tmp_path):
    """{"src", "tgt"} (strings or lists of turns) and {"messages"} lines; a bad line is named by its number; the
    built-in task's message is exactly the one the issue defines."""
    data = tmp_path / "data.jsonl"
    lines = [{"src": "问一", "tgt": "答一"}, {"src": ["问", "再问"], "tgt": ["答", "再答"]},
             {"messages": [{"role": "user", "content": "嗨"}, {"role": "assistant", "content": "你好"}]}]
    data.write_text("\n".join(json.dumps(x, ensure_ascii=False) for x in lines) + "\n")
    config = load_config(None, [f"finetune.data={data}", "data.validation_fraction=0.01"])
    found = sft.records(config)
    messages = [r["messages"] for r in found["train"] + found["validation"]]
    assert len(messages) == 3 and lines[2]["messages"] in messages
    assert [{"role": "user", "content": "问一"}, {"role": "assistant", "content": "答一"}] in messages
    assert [[m["content"] for m in x] for x in messages if len(x) == 4] == [["问", "答", "再问", "再答"]]
    data.write_text(json.dumps(lines[0]) + "\n" + json.dumps({"src": ["a"], "tgt": ["b", "c"]}) + "\n")
    with pytest.raises(ConfigError, match=r"data.jsonl:2: src and tgt"):
        sft.records(config)
    assert sft.review_message("好" * 200, 96) == "评论：" + "好" * 96 + "\n这条评论的情感是正面还是负面？"


def test_fine_tuning_settings_are_checked_before_anything_starts():
    with pytest.raises(ConfigError, match="finetune.method: 'qlora' is not allowed"):
        load_config(None, ["finetune.data=reviews", "finetune.method=qlora"])
    with pytest.raises(ConfigError, match="finetune.data: 'reviews' .* or a .jsonl file, got 'x.txt'"):
        load_config(None, ["finetune.data=x.txt"])
    with pytest.raises(ConfigError, match="PaddleNLP's LoRA wraps fleet's hybrid-parallel layers"):
        load_config(None, ["finetune.data=reviews", "finetune.method=lora", "parallel.mode=semi_auto",
                           "parallel.tensor=2", "training.compile=false"])
    assert load_config(None, ["finetune.data=reviews", "finetune.method=full", "parallel.mode=semi_auto",
                              "parallel.tensor=2", "training.compile=false"]).finetune.method == "full"


def test_examples_are_encoded_once_by_content_and_reused(tokenizer_dir, tmp_path, monkeypatch):
    """The fine-tuning set is encoded once per content key (source bytes, tokenizer and template, settings) in
    chunks whose rows equal the one-shot encoding; a second run links the same files; a changed source is a new
    set; the run sees whole batches only."""
    data = tmp_path / "data.jsonl"
    lines = [{"src": f"评论：{'好' * (i % 7 + 1)}", "tgt": "正面" if i % 2 else "负面"} for i in range(50)]
    data.write_text("\n".join(json.dumps(x, ensure_ascii=False) for x in lines) + "\n")
    monkeypatch.setattr(sft, "CHUNK", 7)  # (several chunks, the last one partial)
    config = load_config(None, [f"finetune.data={data}", "data.validation_fraction=0.2", "training.seq_length=24",
                                f"data.cache_dir={tmp_path / 'cache'}", "training.global_batch_size=4",
                                "parallel.micro_batch_size=4"])
    runs = []
    for name in ("one", "two"):
        run_dir = tmp_path / name
        run_dir.mkdir()
        runs.append(sft.for_run(config, run_dir, tokenizer_dir, log=lambda line: None))
    assert (runs[0]["reused"], runs[1]["reused"]) == (False, True) and runs[0]["encoded"] == runs[1]["encoded"]
    tokenizer, fast = load_tokenizer(tokenizer_dir), fast_tokenizer(tokenizer_dir)
    for split in sft.SPLITS:
        expected = np.stack(sft.encode_all(chat.read(tokenizer_dir), fast, tokenizer.pad_token_id,
                                           [r["messages"] for r in sft.records(config)[split]], 24))
        for name in ("one", "two"):
            assert np.array_equal(np.load(tmp_path / name / "data" / f"sft-{split}.npy"), expected)
    train = runs[0]["train_examples"]
    assert train % 4 == 0 and train + runs[0]["validation_examples"] > 44
    assert len(sft.train_dataset(tmp_path / "one" / "data")) == train
    data.write_text(data.read_text() + json.dumps({"src": "再问", "tgt": "答"}, ensure_ascii=False) + "\n")
    run_dir = tmp_path / "three"
    run_dir.mkdir()
    assert sft.for_run(config, run_dir, tokenizer_dir, log=lambda line: None)["encoded"] != runs[0]["encoded"]
    assert not list((tmp_path / "cache" / "sft").glob(".*.raw")) and \
        len([p for p in (tmp_path / "cache" / "sft").iterdir() if not p.name.startswith(".")]) == 2


def test_the_built_in_task_puts_some_questions_in_a_conversation():
    """finetune.context_share of the review conversations get a system prompt and earlier turns before the same
    question and answer (seeded), never past seq_length; the multi-turn check's turns are not among them."""
    from pipeline.smoke import EARLIER_TURNS

    items = [{"messages": [{"role": "user", "content": sft.review_message("好" * n, 96)},
                           {"role": "assistant", "content": "正面"}], "answer": "正面", "review": "好" * n}
             for n in range(1, 101)]
    assert sft.in_context(items, 0.0, 1, 128) == items
    mixed = sft.in_context(items, 1.0, 1, 128)
    assert mixed == sft.in_context(items, 1.0, 1, 128) and mixed != sft.in_context(items, 1.0, 2, 128)
    longer = [m for m in mixed if len(m["messages"]) > 2]
    assert 30 < len(longer) < 100  # (long reviews keep no context: it would not fit)
    for before, after in zip(items, mixed):
        assert after["messages"][-2:] == before["messages"][-2:]
        assert sum(len(m["content"]) + 4 for m in after["messages"]) < 128 or after == before
        chat.check_request(after["messages"][:-1])  # (a conversation as a chat UI sends it)
    assert 0.2 < sum(len(m["messages"]) > 2 for m in sft.in_context(items, 0.3, 1, 1000)) / len(items) < 0.4
    seen = {message["content"] for conversation in longer for message in conversation["messages"]}
    assert not seen & {m["content"] for m in EARLIER_TURNS}


def test_the_built_in_tool_conversations_learn_when_to_call(tmp_path):
    """finetune.tool_share: that share of the review conversations offer the review tool, half needing it (a review
    named by number: the call, then the label from the tool's result, both learned), half not (the review given:
    the label, no call); the rows learn the call's text and the label, never the tools' definitions or the result."""
    items = [{"messages": [{"role": "user", "content": sft.review_message("好" * n, 96)},
                           {"role": "assistant", "content": "正面"}], "answer": "正面", "review": "好" * n}
             for n in range(1, 201)]
    assert sft.with_tools(items, 0.0, 1) == items
    offered = sft.with_tools(items, 1.0, 1)
    assert offered == sft.with_tools(items, 1.0, 1) and all(i["tools"] == [sft.REVIEW_TOOL] for i in offered)
    calls = [i for i in offered if len(i["messages"]) == 4]
    assert 70 < len(calls) < 130 and all(len(i["messages"]) in (2, 4) for i in offered)
    for item in calls:
        ask, call, result, answer = item["messages"]
        n = json.loads(call["tool_calls"][0]["function"]["arguments"])["n"]
        assert ask["content"] == sft.by_number(n) and result["content"] == item["review"][:sft.TOOL_REVIEW_CHARS]
        assert answer["content"] == item["answer"]
        chat.check_request(item["messages"][:-1])  # (what the agent loop sends the server for the last answer)
    assert 0.3 < sum("tools" in i for i in sft.with_tools(items, 0.4, 1)) / len(items) < 0.5
    # encoded: the call's text and the label are learned, nothing else
    import string

    chars = sorted(set(chat.USER + chat.ASSISTANT + chat.TOOL_RESULT + "好很正面") | set(string.ascii_lowercase +
                                                                                   string.digits + string.punctuation))
    write_tokenizer(SPECIAL_TOKENS + chars + ["##" + c for c in string.ascii_lowercase + string.digits], tmp_path)
    chat.write(tmp_path)
    tokenizer, fast = load_tokenizer(tmp_path), fast_tokenizer(tmp_path)
    item = [{"role": "user", "content": "好"}, *sft.tool_turns(7, "很好"), {"role": "assistant", "content": "正面"}]
    (row,) = sft.encode_all(chat.read(tmp_path), fast, tokenizer.pad_token_id, [chat.plain_messages(item, None)], 160)
    learned = tokenizer.convert_ids_to_tokens([int(t) for t in row[1] if t != sft.IGNORE])
    assert "".join(t.removeprefix("##") for t in learned) == chat.tool_call_text("review", {"n": 7}) + \
        "[SEP]正面[SEP]"
