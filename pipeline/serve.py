"""`make serve` / `make stop` / `make smoke`: the endpoint verbs over serving/ (server start/stop, smoke checks)."""
from __future__ import annotations

import os
from pathlib import Path

from core import registry, tracking
from core.config import Config, ConfigError
from serving.entrypoints import server
from serving.entrypoints.smoke import run_smoke
from serving.state import default_state_dir, read_state, read_worker


def serve(config: Config, model: str, foreground: bool = False) -> int:
    """MODEL: an export directory or models:/<name>/<version|latest> / models:/<name>@<alias> (core/registry.py).
    In the background (returns once ready), or `foreground` (a container's main process: never returns)."""
    state_dir = default_state_dir(config)
    model_dir = registry.resolve(config, model)
    follow = model if model.startswith("models:") else ""  # (a registry reference: the server follows it)
    if foreground:
        print(f"serving {model_dir} in the foreground; ready when {_api(config)}/health/ready answers 200", flush=True)
        server.run_foreground(config, model_dir, state_dir, follow)
    state = server.start(config, model_dir, state_dir, follow)
    workers = read_worker(state_dir).get("workers", [])
    print(f"serving {state['model_dir']} (ready in {state['ready_after_s']}s, pid {state['pid']}; generation workers: "
          + ", ".join(f"pid {w['pid']} ({w['rss_mb']:.0f} MB)" for w in workers) + ")\n"
          f"HTTP: {state['http_url']}\ngRPC: {state['rpc_address']}\n"
          f"OpenAI-compatible: {state['openai_base_url']} (completions, chat/completions, models; stream)\n"
          f"health: {state['api_url']}/health/live, {state['api_url']}/health/ready\n"
          f"metrics: {state['metrics_url']}\nlogs: {state_dir}"
          + (f"\nfollows {follow}: every {config.serving.follow_interval_s:g}s and on `make reload`" if follow else ""))
    return 0


def reload(config: Config) -> int:
    """`make reload`: the running server resolves its models:/ reference again now, and switches if it moved."""
    import requests

    state = read_state(default_state_dir(config))
    if not state:
        raise ConfigError("no running server; start it with `make serve`")
    if not state.get("follows"):
        raise ConfigError(f"the server serves the directory {state['model_dir']}; only a server started with "
                          "MODEL=models:/<name>@<alias> (or /latest) follows the registry")
    key = config.serving.api_key or os.environ.get("PIPELINE_API_KEY", "")
    answer = requests.post(f"{state['api_url']}/admin/reload", timeout=config.serving.start_timeout_s + 30,
                           headers={"Authorization": f"Bearer {key}"} if key else {}).json()
    if "error" in answer and not isinstance(answer["error"], str):
        raise ConfigError(f"reload refused: {answer['error'].get('message')}")
    what = "switched to" if answer["switched"] else "still serving"
    print(f"{state['follows']}: {what} {answer['model']} v{answer['version']} ({answer['model_dir']})"
          + (f"; {answer['error']}" if answer.get("error") else ""))
    return 0 if not answer.get("error") else 1


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
