"""`make smoke`: real HTTP, gRPC and OpenAI-route calls against the running endpoint (serving/client/smoke.py),
then what the served model is and writes."""
from __future__ import annotations

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
    return 1 if failures else 0


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
