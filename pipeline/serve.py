"""`make serve [MODEL=...]`: the endpoint (serving/controller.py starts the server process) in the background,
returning once it is ready, or in the foreground for a container."""
from __future__ import annotations

from core import registry
from core.config import Config
from serving import controller
from serving.state import default_state_dir, read_worker
from pipeline.runner.cli import config_argument, overrides_argument

HELP = "start the Paddle Serving endpoint in the background"


def arguments(p) -> None:
    config_argument(p)
    p.add_argument("--model", default="", help="export directory, models:/<name>/<version>, models:/<name>@<alias> "
                                                "or models:/<name>/latest (default: the newest registered version)")
    p.add_argument("--foreground", action="store_true", help="run the server as this process (containers, "
                                                             "supervisors): its exit code, its signals")
    overrides_argument(p, "section.key=value overrides, e.g. serving.http_port=18280")


def main(config: Config, args) -> int:
    return serve(config, args.model, args.foreground)


def serve(config: Config, model: str, foreground: bool = False) -> int:
    """MODEL: an export directory or models:/<name>/<version|latest> / models:/<name>@<alias> (core/registry.py).
    In the background (returns once ready), or `foreground` (a container's main process: never returns)."""
    state_dir = default_state_dir(config)
    model_dir = registry.resolve(config, model)
    follow = model if model.startswith("models:") else ""  # (a registry reference: the server follows it)
    if foreground:
        print(f"serving {model_dir} in the foreground; ready when {_api(config)}/health/ready answers 200", flush=True)
        controller.run_foreground(config, model_dir, state_dir, follow)
    state = controller.start(config, model_dir, state_dir, follow)
    workers = read_worker(state_dir).get("workers", [])
    print(f"serving {state['model_dir']} (ready in {state['ready_after_s']}s, pid {state['pid']}; generation workers: "
          + ", ".join(f"pid {w['pid']} ({w['rss_mb']:.0f} MB)" for w in workers) + ")\n"
          f"HTTP: {state['http_url']}\ngRPC: {state['rpc_address']}\n"
          f"OpenAI-compatible: {state['openai_base_url']} (completions, chat/completions, models; stream)\n"
          f"health: {state['api_url']}/health/live, {state['api_url']}/health/ready\n"
          f"metrics: {state['metrics_url']}\nlogs: {state_dir}"
          + (f"\nfollows {follow}: every {config.serving.follow_interval_s:g}s and on `make reload`" if follow else ""))
    return 0


def _api(config: Config) -> str:
    return f"http://{config.serving.host}:{config.serving.api_port}"
