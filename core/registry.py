"""Which export directory to serve: `MODEL=` as a path, a registry URI, or the newest registered version.

    MODEL=exports/<name>/<version>     an export directory on this machine
    MODEL=models:/<name>/<version>     a registered version (MLflow's URI convention)
    MODEL=models:/<name>@<alias>       the version an alias points at
    MODEL=models:/<name>/latest        the newest version
    (empty)                            the newest version of export.registered_model_name

A registered version is served from `<exports_dir>/<name>/<version>/` when that directory holds the same weights
(checked by hash); otherwise its files are downloaded from the source run's artifacts into that directory first
(staged, then renamed: an interrupted download leaves nothing that looks complete).
"""
from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path

from core import REPO_ROOT, exportdir, tracking
from core.config import Config, ConfigError

_MODELS_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:/(?P<version>\d+|latest)|@(?P<alias>[\w-]+))$")


def parse_models_uri(uri: str) -> tuple[str, str | None, str | None]:
    """models:/<name>/<version|latest> or models:/<name>@<alias> -> (name, version, alias)."""
    match = _MODELS_URI.match(uri)
    if not match:
        raise ConfigError(f"MODEL={uri}: expected models:/<name>/<version>, models:/<name>/latest or "
                          f"models:/<name>@<alias>")
    return match["name"], match["version"], match["alias"]


def resolve(config: Config, model: str = "") -> Path:
    """The local export directory to serve (downloaded from the registry when needed)."""
    if model and not model.startswith("models:"):
        path = Path(model).resolve()
        exportdir.read_meta(path)  # a clear error when it is not an export directory
        return path
    uri = tracking.tracking_uri(config.tracking)
    tracking.check_reachable(uri)
    client = tracking.client(uri)
    name, version, alias = parse_models_uri(model) if model else (config.export.registered_model_name, "latest", None)
    version_info = _model_version(client, name, version, alias)
    target = (REPO_ROOT / config.export.exports_dir / name / str(version_info.version)).resolve()
    for candidate in (target, Path(version_info.tags.get("export_dir", ""))):
        if _holds(candidate, version_info):
            return candidate
    return _download(client, version_info, target)


def model_version(client, uri: str):
    """The registry's entry for models:/<name>/<version>, models:/<name>@<alias> or models:/<name>/latest."""
    return _model_version(client, *parse_models_uri(uri))


def _model_version(client, name: str, version: str | None, alias: str | None):
    from mlflow.exceptions import MlflowException

    try:
        if alias:
            return client.get_model_version_by_alias(name, alias)
        if version == "latest":
            versions = client.search_model_versions(f"name='{name}'")
            if not versions:
                raise ConfigError(f"no registered version of {name!r}; run `make export` first or pass MODEL=<dir>")
            return max(versions, key=lambda v: int(v.version))
        return client.get_model_version(name, version)
    except MlflowException as exc:
        raise ConfigError(f"model {name!r} {'@' + alias if alias else 'version ' + str(version)} is not in the "
                          f"registry ({exc.error_code})") from None


def _holds(path: Path, version_info) -> bool:
    """Is `path` an export directory of exactly this registered version (same run, same weights)?"""
    if not str(path) or not exportdir.is_complete(path):
        return False
    meta = exportdir.read_meta(path)
    return str(meta["version"]) == str(version_info.version) and meta["source_run_id"] == version_info.run_id


def _download(client, version_info, target: Path) -> Path:
    artifact_path = version_info.tags.get("artifact_path") or (
        _parse_runs_uri(version_info.source)[1] if version_info.source.startswith("runs:/") else "")
    if not artifact_path:
        raise ConfigError(f"version {version_info.version} of {version_info.name!r} has no run artifacts to download "
                          f"(source {version_info.source}); export it again")
    if target.exists():
        raise ConfigError(f"{target} exists but is not version {version_info.version} of {version_info.name!r}; move "
                          f"it away")
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"downloading {version_info.name!r} version {version_info.version} from runs:/{version_info.run_id}/"
          f"{artifact_path}", flush=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=target.parent) as tmp:
        try:
            local = Path(client.download_artifacts(version_info.run_id, artifact_path, tmp))
        except Exception as exc:  # noqa: BLE001  (store / network errors)
            raise ConfigError(f"could not download version {version_info.version} of {version_info.name!r} "
                              f"({exc.__class__.__name__}: {str(exc)[:200]})") from None
        if not _holds(local, version_info):
            raise ConfigError(f"the artifacts of version {version_info.version} of {version_info.name!r} are not a "
                              f"complete export (export.json / weights hash mismatch)")
        shutil.move(str(local), str(target))
    return target


def _parse_runs_uri(uri: str) -> tuple[str, str]:
    """`runs:/<run>/<path>` -> (run id, path), with MLflow's own parser."""
    from mlflow.store.artifact.runs_artifact_repo import RunsArtifactRepository

    return RunsArtifactRepository.parse_runs_uri(uri)
