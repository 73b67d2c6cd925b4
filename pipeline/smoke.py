"""`make smoke`: real HTTP, gRPC and OpenAI-route calls against the running endpoint (serving/client/smoke.py),
then what the served model is and writes."""
from __future__ import annotations

import json
import os
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor

from core import tracking
from core.config import Config, ConfigError, load_config
from serving.client.smoke import run_smoke
from serving.state import default_state_dir, read_state
from core import chat, exportdir
from evaluation.grading import task_accuracy
from pipeline.runner.cli import config_argument, overrides_argument
from serving.client.client import GenerationClient
from training.finetune import data as sft
from training.finetune.preference import held_out_task

HELP = "real HTTP/gRPC calls against the running endpoint"


def arguments(p) -> None:
    config_argument(p)
    overrides_argument(p)


def main(config: Config, args) -> int:
    return smoke(config)


def smoke(config: Config) -> int:
    state = read_state(default_state_dir(config))
    if not state:
        raise ConfigError("no running server; start it with `make serve`")
    failures = run_smoke(state, tracking.client(tracking.tracking_uri(config.tracking)))
    print("SMOKE", "PASS" if not failures else f"FAIL ({len(failures)} checks)")
    if not failures:
        print(samples(state, config.serving.default_max_new_tokens))

        meta = exportdir.read_meta(Path(state["model_dir"]))
        if exportdir.fine_tuned(meta):  # (a fine-tuned model: its task through the chat route)
            print(chat_task(state, meta))
            if load_config(Path(meta["run_dir"]) / "config.yaml").finetune.tool_share:
                print(tool_task(state, meta))
    return 1 if failures else 0


# Two earlier turns unrelated to the question, after a system prompt, as a chat UI sends a conversation: the answer to
# a held-out question must not change behind them (issue: >= 95% of 100 the same).
EARLIER_TURNS = [{"role": "system", "content": "你是一个有用的助手。"},
                 {"role": "user", "content": "你好"}, {"role": "assistant", "content": "你好！请问有什么可以帮你？"},
                 {"role": "user", "content": "我想看看几条评论。"}, {"role": "assistant", "content": "好的，请发给我。"}]
MULTI_TURN = 100  # held-out questions asked again after EARLIER_TURNS


def chat_task(state: dict, meta: dict, shown: int = 3) -> str:
    """A fine-tuned model's held-out task through the served /v1/chat/completions (the real `openai` client, 8 at a
    time, greedy): `shown` examples, the accuracy over all of them and per expected answer (their mean: the
    balanced accuracy), and how often the first MULTI_TURN answers stay the same behind EARLIER_TURNS."""
    import openai


    run_config = load_config(Path(meta["run_dir"]) / "config.yaml")
    task = held_out_task(run_config, chat.read(Path(state["model_dir"]) / "tokenizer"))
    client = openai.OpenAI(base_url=state["openai_base_url"], api_key=os.environ.get("PIPELINE_API_KEY", "unused"),
                           max_retries=2)

    def ask(messages: list[dict]) -> str | None:
        try:
            answer = client.chat.completions.create(model=meta["registered_model_name"], messages=messages,
                                                    max_tokens=8, temperature=0)
        except openai.BadRequestError:  # (a conversation over serving.max_prompt_chars: refused, counted apart)
            return None
        return (answer.choices[0].message.content or "").strip()

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, [t["messages"] for t in task]))
        later = list(pool.map(ask, [EARLIER_TURNS + t["messages"] for t in task[:MULTI_TURN]]))
    score = task_accuracy(task, answers)
    lines = [f"chat (/v1/chat/completions, {run_config.finetune.data}, held out):"]
    for example, answer in list(zip(task, answers))[:shown]:
        question = example["messages"][-1]["content"].replace("\n", " ")
        lines.append(f"  {question[:60]}{'...' if len(question) > 60 else ''} -> {answer!r} (expected "
                     f"{example['answer']})")
    lines.append(f"  task accuracy {score['accuracy']:.4f}: {score['right']} of {score['total']} held-out examples "
                 "answered exactly")
    if score["balanced"] is not None:  # (a classification task: each answer's recall, and the balanced accuracy)
        lines.append("  per expected answer: " + ", ".join(f"{e} {r:.4f} of {n}" for e, (r, n) in
                                                           score["recall"].items()) +
                     f"; balanced accuracy {score['balanced']:.4f}; answers given: " +
                     ", ".join(f"{a!r} {n}" for a, n in score["given"].most_common(4)))
    asked = [(a, b) for a, b in zip(answers, later) if b is not None]
    same = sum(a == b for a, b in asked)
    lines.append(f"  multi-turn: {same} of {len(asked)} answers unchanged after a system prompt and two unrelated "
                 f"turns" + (f" ({len(later) - len(asked)} longer than serving.max_prompt_chars: refused)"
                             if len(asked) < len(later) else ""))
    return "\n".join(lines)


TOOL_QUESTIONS = 100  # held-out reviews asked with the tool offered: half by number, half given


def tool_task(state: dict, meta: dict, count: int = TOOL_QUESTIONS) -> str:
    """A model fine-tuned with finetune.tool_share, through the served chat route with the review tool offered and
    tool_choice auto: held-out reviews asked by number (the tool is needed) and given in the question (it is not);
    how often each calls the tool, and the label answered once the tool's result (the review) is sent back."""
    import openai


    reviews = sft.records(load_config(Path(meta["run_dir"]) / "config.yaml"))["validation"][:count]
    client = openai.OpenAI(base_url=state["openai_base_url"], api_key=os.environ.get("PIPELINE_API_KEY", "unused"),
                           max_retries=2)
    asked = dict(model=meta["registered_model_name"], tools=[sft.REVIEW_TOOL], max_tokens=64, temperature=0)

    def ask(k: int) -> tuple[bool, bool, str | None, bool]:
        """(needs the tool, called it, the answer after the tool's result: None when not asked or refused, the
        call's number that of the question)"""
        item, needed = reviews[k], k % 2 == 0
        question = sft.by_number(k + 1) if needed else sft.review_message(item["review"], sft.TOOL_REVIEW_CHARS)
        messages = [{"role": "user", "content": question}]
        first = client.chat.completions.create(messages=messages, **asked).choices[0].message
        if not first.tool_calls:
            return needed, False, None, False
        n = json.loads(first.tool_calls[0].function.arguments).get("n")  # (the tool answers with review k)
        result = sft.tool_turns(n, item["review"], first.tool_calls[0].id)[1]
        try:
            final = client.chat.completions.create(messages=messages + [first.model_dump(exclude_none=True), result],
                                                   **asked).choices[0].message
        except openai.BadRequestError:  # (longer than serving.max_prompt_chars: counted as a wrong label)
            return needed, True, None, n == k + 1
        return needed, True, final.content or "", n == k + 1

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(len(reviews))))
    need = [a for a in answers if a[0]]
    free = [a for a in answers if not a[0]]
    called = [k for k, a in enumerate(answers) if a[0] and a[1]]
    labels = task_accuracy([reviews[k] for k in called], [answers[k][2] for k in called])
    return (f"tools (/v1/chat/completions, tool_choice auto, the review tool offered): called on "
            f"{sum(a[1] for a in need)} of {len(need)} held-out questions that need it, on {sum(a[1] for a in free)} "
            f"of {len(free)} that do not ({sum(a[3] for a in need)} calls with the question's number); after the "
            f"tool's result, {labels['right']} of {labels['total']} labels right")


def samples(state: dict, max_new_tokens: int) -> str:
    """What the served model is: its eval metric and greedy continuations of the reference prompts."""
    meta = exportdir.read_meta(Path(state["model_dir"]))
    metric, value = meta.get("metric", "eval_loss"), float(meta.get("metric_value", "nan"))
    ppl = f" (perplexity {tracking.perplexity(value):.0f})" if metric == "eval_loss" else ""
    lines = [f"model {meta['registered_model_name']} v{meta['version']}: checkpoint step {meta['checkpoint_step']} "
             f"of run {meta.get('source_run_name', meta['source_run_id'])}, {metric} {value:.3f}{ppl}"]
    client = GenerationClient(state["http_url"], timeout=60)
    for prompt in exportdir.REFERENCE_PROMPTS:
        lines.append(f"  {prompt} -> {client.generate(prompt, max_new_tokens=max_new_tokens).text}")
    return "\n".join(lines)
