"""`make reload`: a server started with MODEL=models:/<name>@<alias> (or /latest) resolves it again now."""
from __future__ import annotations

import os

from core.config import Config, ConfigError
from serving.state import default_state_dir, read_state
from pipeline.runner.cli import config_argument, overrides_argument

HELP = "the running endpoint resolves its models:/ reference again and switches if it moved"


def arguments(p) -> None:
    config_argument(p)
    overrides_argument(p)


def main(config: Config, args) -> int:
    return reload(config)


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
