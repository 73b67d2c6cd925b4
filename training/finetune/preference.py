"""Preference data (finetune.method=dpo / simpo, docs/finetune.md): prompts with a chosen and a rejected answer ->
pairs of fixed-length rows, and the reference model's log-probabilities of both, computed once.

    sources    the built-in review task (each review of training/finetune/data.py's split, its context and tools
               included: chosen the right label, rejected the other one), or a .jsonl file of TRL's
               {"prompt" | "messages", "chosen", "rejected"} (strings, or conversations: the prompt's messages, the
               answers' assistant message) or PaddleNLP's alignment rows {"src", "tgt", "response", "sort"} (src the
               user turns, tgt the assistant's earlier answers, response two answers, sort their ranks: higher is
               better). A row without a rejected answer, with the two answers equal, or longer than the context is
               refused in one line naming the file and the line. A file from a model's own mistakes: its answers
               to training prompts (never the held-out ones), each wrong one a row, chosen the right answer and
               rejected what the model said (docs/finetune.md).
    encoding   each answer rendered after the prompt with the run's chat template as supervised data is
               (training/finetune/data.py encode_all), the last answer learned alone (the prompt's earlier turns are
               context); files data/pref-<split>.npy, int32 [pairs, 4, seq_length] (chosen ids, chosen labels,
               rejected ids, rejected labels), encoded once per content key under data.cache_dir/pref/<key>/
    reference  dpo: the log-probability of each answer (summed over its tokens) under the model the run starts from,
               reference-<model key>-<split>-<pairs>.npy float32 [pairs, 2] beside the encoded set: computed by the
               ranks before the first step when missing, reused by every later run on the same data and model (the
               model key hashes its weight files). With LoRA the reference is that same model: the adapters start at
               zero, so the model the adapters start from, trained head included, is what the run starts from.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import numpy as np
from numpy.lib.format import open_memmap

from core import chat
from core.errors import ConfigError, json_object
from core.hf_checkpoint import weight_files
from core.tokenizer import fast_tokenizer, load_tokenizer
from training.data.corpus import split_rule
from training.finetune import data as sft

FILE = "pref-{split}.npy"
REFERENCE = "reference-{model}-{split}-{pairs}.npy"
FORMATS = ('{"prompt" | "messages", "chosen", "rejected"} (TRL) or {"src", "tgt", "response", "sort"} '
           '(PaddleNLP)')


def records(config) -> dict[str, list[dict]]:
    """{split: [{"prompt": messages, "chosen": str, "rejected": str, "tools"?, "where": "file:line"}]}."""
    if config.finetune.data == "reviews":
        other = {sft.LABELS["pos"]: sft.LABELS["neg"], sft.LABELS["neg"]: sft.LABELS["pos"]}
        return {split: [{"prompt": item["messages"][:-1], "chosen": item["answer"], "rejected": other[item["answer"]],
                         "tools": item.get("tools"), "where": f"reviews:{split}:{n}"}
                        for n, item in enumerate(items, 1)]
                for split, items in sft.records(config).items()}
    path = Path(config.finetune.data).expanduser()
    if not path.is_file():
        raise ConfigError(f"finetune.data={config.finetune.data}: no such file")
    is_validation = split_rule(config.data.split_seed, config.data.validation_fraction)
    out: dict[str, list[dict]] = {split: [] for split in sft.SPLITS}
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                pair = parse(line, f"{path}:{number}")
                out["validation" if is_validation(line.strip()) else "train"].append(pair)
    return out


def parse(line: str, where: str) -> dict:
    """One preference row in either format -> {"prompt", "chosen", "rejected", "where"}; a bad row in one line."""
    row = json_object(line, where, FORMATS)
    if "response" in row or "sort" in row:
        prompt, chosen, rejected = _paddlenlp_row(row, where)
    elif "prompt" in row or "messages" in row or "chosen" in row:
        for key in ("chosen", "rejected"):
            if key not in row:
                raise ConfigError(f"{where}: no {key!r} (a preference row is {FORMATS})")
        prompt = row["prompt"] if "prompt" in row else row["messages"]
        prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        chosen, rejected = _answer(row["chosen"], "chosen", where), _answer(row["rejected"], "rejected", where)
    else:
        raise ConfigError(f"{where}: expected {FORMATS}")
    if chosen == rejected:
        raise ConfigError(f"{where}: chosen and rejected are the same answer ({chosen[:40]!r}): nothing to prefer")
    prompt = sft.checked_messages(prompt, where, "the prompt (a string, or messages)", answered=False)
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected, "where": where}


def _answer(value, key: str, where: str) -> str:
    """An answer as a string, or as TRL's conversational [{"role": "assistant", "content": ...}]."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], dict) \
            and value[0].get("role") == "assistant":
        value = value[0].get("content")
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: {key!r} must be a non-empty string or one assistant message")
    return value


def _paddlenlp_row(row: dict, where: str) -> tuple[list[dict], str, str]:
    for key in ("src", "tgt", "response", "sort"):
        if key not in row:
            raise ConfigError(f"{where}: no {key!r} (a preference row is {FORMATS})")
    src, tgt = ([row["src"]] if isinstance(row["src"], str) else row["src"]), row["tgt"]
    tgt = [tgt] if isinstance(tgt, str) else tgt
    response, sort = row["response"], row["sort"]
    if not (isinstance(src, list) and src and isinstance(tgt, list) and len(tgt) == len(src) - 1
            and all(isinstance(x, str) for x in src + tgt)):
        raise ConfigError(f"{where}: src must be the user turns and tgt the assistant's answers before the last "
                          f"(one fewer), all strings")
    if not (isinstance(response, list) and len(response) == 2 and all(isinstance(r, str) and r for r in response)
            and isinstance(sort, list) and len(sort) == 2 and all(isinstance(x, (int, float)) for x in sort)):
        raise ConfigError(f"{where}: response must be two answers and sort their two ranks (higher is better)")
    if sort[0] == sort[1]:
        raise ConfigError(f"{where}: sort ranks the two responses equal: nothing to prefer")
    best = 0 if sort[0] > sort[1] else 1
    return sft.alternating(src, tgt), response[best], response[1 - best]


def content_key(config, tokenizer_dir: Path) -> str:
    return sft.content_key(config, tokenizer_dir, extra=(Path(__file__),))


def encode(config, tokenizer_dir: Path, out: Path) -> None:
    """Every split's pairs into out/pref-<split>.npy and the counts into out/set.json. A file's pair longer than
    training.seq_length + 1 tokens is refused (naming its line); the built-in task's are left out and counted."""
    tokenizer, fast, template = load_tokenizer(tokenizer_dir), fast_tokenizer(tokenizer_dir), chat.read(tokenizer_dir)
    seq, stats = config.training.seq_length, {}
    for split, pairs in records(config).items():
        rows, too_long, answers = [], 0, 0
        for start in range(0, len(pairs), sft.CHUNK):
            chunk = pairs[start:start + sft.CHUNK]
            conversations = [chat.plain_messages([*p["prompt"], {"role": "assistant", "content": p[side]}],
                                                 p.get("tools")) for p in chunk for side in ("chosen", "rejected")]
            encoded = sft.encode_all(template, fast, tokenizer.pad_token_id, conversations, seq, last_only=True)
            for pair, chosen, rejected in zip(chunk, encoded[0::2], encoded[1::2]):
                if chosen is None or rejected is None:
                    if config.finetune.data != "reviews":
                        raise ConfigError(f"{pair['where']}: the prompt with its answers is longer than "
                                          f"training.seq_length={seq} tokens (+1); shorten it or raise seq_length")
                    too_long += 1
                    continue
                rows.append(np.concatenate([chosen, rejected]))
                answers += int((chosen[1] != sft.IGNORE).sum() + (rejected[1] != sft.IGNORE).sum())
        stored = open_memmap(out / FILE.format(split=split), mode="w+", dtype=np.int32, shape=(len(rows), 4, seq))
        if rows:
            stored[:] = np.stack(rows)
        stored.flush()
        del stored
        stats.update({f"{split}_examples": len(rows), f"{split}_too_long": too_long, f"{split}_answer_tokens": answers})
    stats["vocab_size"] = len(tokenizer)
    (out / sft.SET_STATS).write_text(json.dumps(stats, indent=2))


# (one pass at most, TRL's default of one epoch: the first max_steps x global_batch_size pairs of the seeded order,
# so the reference is computed for the pairs the run sees and no more)
ENCODING = sft.Encoding("pref", FILE, content_key, encode, one_pass=True)


def for_run(config, run_dir: Path, tokenizer_dir: Path, log=print) -> dict:
    """The run's tokenizer and pairs (training/finetune/data.py for_run), and for dpo the reference it needs: its
    model key and whether its log-probabilities are there already (the ranks compute them when not)."""
    stats = sft.for_run(config, run_dir, tokenizer_dir, log, encoding=ENCODING)
    if config.finetune.method == "dpo":
        model = reference_key(config.model.init_from)
        files = {split: REFERENCE.format(model=model, split=split, pairs=stats[f"{split}_examples"])
                 for split in sft.SPLITS}
        ready = all((Path(stats["encoded"]) / name).is_file() for name in files.values())
        stats.update(reference_model=model, reference_files=files, reference_reused=ready)
        (run_dir / "data" / "stats.json").write_text(json.dumps(stats, indent=2))
        log(f"reference log-probabilities ({config.model.init_from}, key {model}): "
            + ("computed before, reused" if ready else "computed by the ranks before the first step"))
    return stats


def held_out_task(config, template, limit: int | None = None) -> list[dict]:
    """Any fine-tuning run's held-out task as served (training/finetune/data.py held_out): a supervised run's or the
    built-in task's examples, or each validation pair's prompt with its chosen answer expected."""
    if not config.preference_tuning or config.finetune.data == "reviews":
        return sft.held_out(config, template, limit)
    return [{"messages": p["prompt"], "prompt": chat.render_messages(template, p["prompt"]), "answer": p["chosen"]}
            for p in records(config)["validation"][:limit]]


def supervised_rows(config, run_dir: Path) -> np.ndarray:
    """[examples, 2, seq_length] (input ids, labels) of the validation answers a preference run is judged on: the
    built-in task's supervised rows (the same conversations, encoded as an SFT run of the same settings encodes them:
    the same set, so an SFT version and a DPO version of one base are evaluated on one held-out set), or each pair's
    prompt with its chosen answer."""
    if config.finetune.data == "reviews":
        encoded, _ = sft.encoded_set(config, Path(run_dir) / "tokenizer", Path(run_dir), log=lambda line: None)
        return np.load(encoded / sft.FILE.format(split="validation"))
    return np.ascontiguousarray(np.load(Path(run_dir) / "data" / FILE.format(split="validation"))[:, :2])


def reference_key(model_dir: str) -> str:
    """The reference model's identity: a hash of its config and weight files' bytes (those from_pretrained loads:
    model_state.pdparams, else the safetensors shards its index names; not the optimizer's or scheduler's state),
    so the same weights in another directory give the same key and another checkpoint another key."""
    root = Path(model_dir).expanduser()
    if not (root / "config.json").is_file():
        raise ConfigError(f"model.init_from={model_dir}: no config.json: not a model to take as the dpo reference")
    pdparams = root / "model_state.pdparams"
    h = hashlib.sha256()
    sft.hash_files(h, [root / "config.json", *([pdparams] if pdparams.is_file() else weight_files(root)),
                       Path(__file__)])
    return h.hexdigest()[:16]


class Pairs(sft.Examples):
    """A split's pairs as the Trainer feeds them: {"chosen_input_ids", "chosen_labels", "rejected_input_ids",
    "rejected_labels"} (+ "reference" [2] for dpo), memory-mapped."""

    def __init__(self, path: Path, limit: int | None = None, reference: np.ndarray | None = None):
        super().__init__(path, limit)
        self.reference = reference

    def __getitem__(self, i: int) -> dict:
        row = np.asarray(self.rows[i], dtype=np.int64)
        item = {"chosen_input_ids": row[0], "chosen_labels": row[1], "rejected_input_ids": row[2],
                "rejected_labels": row[3]}
        if self.reference is not None:
            item["reference"] = np.asarray(self.reference[i], dtype=np.float32)
        return item


def datasets(run_data: Path, eval_limit: int) -> tuple[Pairs, Pairs]:
    """(training pairs in whole batches, the first `eval_limit` validation pairs), each with its reference
    log-probabilities for dpo (computed before: `reference_logps`)."""
    stats = json.loads((Path(run_data) / "stats.json").read_text())
    files = stats.get("reference_files")
    reference = {split: np.load(Path(run_data) / files[split]) for split in sft.SPLITS} if files else {}
    return (Pairs(Path(run_data) / FILE.format(split="train"), stats["train_examples"], reference.get("train")),
            Pairs(Path(run_data) / FILE.format(split="validation"), eval_limit, reference.get("validation")))


def ensure_reference(run_data: Path, logps_of, batch: int, log=print) -> None:
    """dpo: the reference log-probabilities of every pair of both splits, in the run's data directory: linked from
    the encoded set, computed now with `logps_of(ids, labels) -> [rows]` (the model as it starts) when the launcher
    found none. Every rank computes (the model's forward is collective under tensor parallel) and publishes by
    rename, so a killed run leaves no half-written file and concurrent ranks write the same bytes."""
    stats = json.loads((Path(run_data) / "stats.json").read_text())
    if "reference_files" not in stats:
        return
    encoded = Path(stats["encoded"])
    for split, name in stats["reference_files"].items():
        target = encoded / name
        # (computed when the launcher found none and this run has not linked it yet: a resume reuses its own. Under
        # tensor parallel no rank can finish, and link, before every rank has joined the forward's collectives)
        if not stats["reference_reused"] and not (Path(run_data) / name).exists():
            rows = np.load(Path(run_data) / FILE.format(split=split), mmap_mode="r")[:stats[f"{split}_examples"]]
            values = reference_logps(rows, logps_of, batch)
            handle, staging = tempfile.mkstemp(prefix=f".{name}.", dir=encoded)
            with os.fdopen(handle, "wb") as sink:
                np.save(sink, values)
            os.replace(staging, target)
            log(f"reference log-probabilities of {len(values):,} {split} pairs -> {target}")
        if target != Path(run_data) / name and not (Path(run_data) / name).exists():
            try:
                sft.link(target, Path(run_data) / name)
            except FileExistsError:  # (another rank linked it)
                pass


def reference_logps(rows: np.ndarray, logps_of, batch: int) -> np.ndarray:
    """[pairs, 2] float32: each pair's chosen and rejected log-probabilities, `batch` pairs at a time (the last
    batch filled with repeats so every forward has the training step's shape)."""
    out = np.zeros((len(rows), 2), dtype=np.float32)
    for start in range(0, len(rows), batch):
        block = np.asarray(rows[start:start + batch], dtype=np.int64)
        real = len(block)
        if real < batch:
            block = np.concatenate([block, np.repeat(block[-1:], batch - real, axis=0)])
        values = np.asarray(logps_of(np.concatenate([block[:, 0], block[:, 2]]),
                                     np.concatenate([block[:, 1], block[:, 3]])), dtype=np.float32)
        out[start:start + real, 0], out[start:start + real, 1] = values[:real], values[batch:batch + real]
    return out
