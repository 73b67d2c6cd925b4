"""`make serve` / `make stop` / `make smoke`: the endpoint verbs over serving/ (server start/stop, smoke checks)."""
from __future__ import annotations

from pathlib import Path

from pipeline import models

from core import tracking
from core.config import Config, ConfigError
from serving.entrypoints import server
from serving.entrypoints.smoke import run_smoke
from serving.state import default_state_dir, read_state, read_worker


def serve(config: Config, model: str, foreground: bool = False) -> int:
    """MODEL: an export directory or models:/<name>/<version|latest> / models:/<name>@<alias> (pipeline/models.py).
    In the background (returns once ready), or `foreground` (a container's main process: never returns)."""
    state_dir = default_state_dir(config)
    model_dir = models.resolve(config, model)
    if foreground:
        print(f"serving {model_dir} in the foreground; ready when {_api(config)}/health/ready answers 200", flush=True)
        server.run_foreground(config, model_dir, state_dir)
    state = server.start(config, model_dir, state_dir)
    workers = read_worker(state_dir).get("workers", [])
    print(f"serving {state['model_dir']} (ready in {state['ready_after_s']}s, pid {state['pid']}; generation workers: "
          + ", ".join(f"pid {w['pid']} ({w['rss_mb']:.0f} MB)" for w in workers) + ")\n"
          f"HTTP: {state['http_url']}\ngRPC: {state['rpc_address']}\n"
          f"OpenAI-compatible: {state['openai_base_url']} (completions, chat/completions, models; stream)\n"
          f"health: {state['api_url']}/health/live, {state['api_url']}/health/ready\n"
          f"metrics: {state['metrics_url']}\nlogs: {state_dir}")
    return 0


def _api(config: Config) -> str:
    return f"http://{config.serving.host}:{config.serving.api_port}"


def stop(config: Config) -> int:
    print("stopped" if server.stop(default_state_dir(config)) else "no server was running")
    return 0


def smoke(config: Config) -> int:
    state = read_state(default_state_dir(config))
    if not state:
        raise ConfigError("no running server; start it with `make serve`")
    failures = run_smoke(state, tracking.client(tracking.tracking_uri(config)))
    print("SMOKE", "PASS" if not failures else f"FAIL ({len(failures)} checks)")
    if not failures:
        print(samples(state, config.serving.default_max_new_tokens))
    return 1 if failures else 0


def samples(state: dict, max_new_tokens: int) -> str:
    """What the served model is: its eval metric and greedy continuations of the reference prompts."""
    from core import exportdir
    from serving.entrypoints.client import GenerationClient

    meta = exportdir.read_meta(Path(state["model_dir"]))
    metric, value = meta.get("metric", "eval_loss"), float(meta.get("metric_value", "nan"))
    ppl = f" (perplexity {tracking.perplexity(value):.0f})" if metric == "eval_loss" else ""
    lines = [f"model {meta['registered_model_name']} v{meta['version']}: checkpoint step {meta['checkpoint_step']} "
             f"of run {meta.get('source_run_name', meta['source_run_id'])}, {metric} {value:.3f}{ppl}"]
    client = GenerationClient(state["http_url"], timeout=60)
    for prompt in exportdir.REFERENCE_PROMPTS:
        lines.append(f"  {prompt} -> {client.generate(prompt, max_new_tokens=max_new_tokens).text}")
    return "\n".join(lines)
