"""`make smoke`: real HTTP, gRPC and OpenAI-route calls against the running endpoint (serving/client/smoke.py),
then what the served model is and writes."""
from __future__ import annotations

import os
from pathlib import Path

from core import tracking
from core.config import Config, ConfigError
from serving.client.smoke import run_smoke
from serving.state import default_state_dir, read_state


def main(config: Config, args) -> int:
    return smoke(config)


def smoke(config: Config) -> int:
    state = read_state(default_state_dir(config))
    if not state:
        raise ConfigError("no running server; start it with `make serve`")
    failures = run_smoke(state, tracking.client(tracking.tracking_uri(config)))
    print("SMOKE", "PASS" if not failures else f"FAIL ({len(failures)} checks)")
    if not failures:
        print(samples(state, config.serving.default_max_new_tokens))
        from core import exportdir

        meta = exportdir.read_meta(Path(state["model_dir"]))
        if meta.get("finetune_data"):  # (a fine-tuned model: its task through the chat route)
            print(chat_task(state, meta))
    return 1 if failures else 0


def chat_task(state: dict, meta: dict, shown: int = 3) -> str:
    """A fine-tuned model's held-out task through the served /v1/chat/completions (the real `openai` client, 8 at a
    time, greedy): `shown` examples and the accuracy over all of them."""
    from concurrent.futures import ThreadPoolExecutor

    import openai

    from core import chat
    from core.config import load_config
    from training.data.sft import held_out

    run_config = load_config(Path(meta["run_dir"]) / "config.yaml")
    task = held_out(run_config, chat.read(Path(state["model_dir"]) / "tokenizer"))
    client = openai.OpenAI(base_url=state["openai_base_url"], api_key=os.environ.get("PIPELINE_API_KEY", "unused"),
                           max_retries=2)

    def ask(example: dict) -> str:
        answer = client.chat.completions.create(model=meta["registered_model_name"], messages=example["messages"],
                                                max_tokens=8, temperature=0)
        return (answer.choices[0].message.content or "").strip()

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, task))
    right = sum(a == t["answer"] for a, t in zip(answers, task))
    lines = [f"chat (/v1/chat/completions, {run_config.finetune.data}, held out):"]
    for example, answer in list(zip(task, answers))[:shown]:
        question = example["messages"][-1]["content"].replace("\n", " ")
        lines.append(f"  {question[:60]}{'...' if len(question) > 60 else ''} -> {answer!r} (expected "
                     f"{example['answer']})")
    lines.append(f"  task accuracy {right / max(len(task), 1):.4f}: {right} of {len(task)} held-out examples "
                 "answered exactly")
    return "\n".join(lines)


def samples(state: dict, max_new_tokens: int) -> str:
    """What the served model is: its eval metric and greedy continuations of the reference prompts."""
    from core import exportdir
    from serving.client.client import GenerationClient

    meta = exportdir.read_meta(Path(state["model_dir"]))
    metric, value = meta.get("metric", "eval_loss"), float(meta.get("metric_value", "nan"))
    ppl = f" (perplexity {tracking.perplexity(value):.0f})" if metric == "eval_loss" else ""
    lines = [f"model {meta['registered_model_name']} v{meta['version']}: checkpoint step {meta['checkpoint_step']} "
             f"of run {meta.get('source_run_name', meta['source_run_id'])}, {metric} {value:.3f}{ppl}"]
    client = GenerationClient(state["http_url"], timeout=60)
    for prompt in exportdir.REFERENCE_PROMPTS:
        lines.append(f"  {prompt} -> {client.generate(prompt, max_new_tokens=max_new_tokens).text}")
    return "\n".join(lines)
