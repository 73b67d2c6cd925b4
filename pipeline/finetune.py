"""`make finetune [MODEL=<run id | checkpoint directory | models:/...>] [DATA=reviews|<file.jsonl>]`: supervised
fine-tuning (full or LoRA: finetune.method) of a trained model, as a training run of its own (docs/finetune.md).

    base     what it starts from: MODEL (an MLflow run id: its best checkpoint; a registered version: the checkpoint
             it was exported from; a directory of PaddleNLP weights with its tokenizer), else model.init_from, else
             the best FINISHED run of finetune.base_experiment. A checkpoint that is not on this machine is
             downloaded from the run's artifacts into <runs_dir>/.bases/ (kept: a resume and the export read it).
    config   CONFIG (default configs/tiny-chat.yaml) with the base's model shape, model.init_from, its tokenizer
             (the chat template is added to the run's copy), and its train/validation split rule (so held-out
             examples are the base's held-out documents); then `make train`'s machinery
             (training/launch/train_run.py): a new MLflow run tagged with its base (pipeline.base), resumable with RESUME=<run>.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from core import tracking
from core.hf_checkpoint import rope_scaling_of
from core.config import Config, ConfigError, load_config
from training.launch import rundir, train_run
from pipeline.runner import source_run
from core.registry import model_version
from pipeline.runner.cli import overrides_argument

HELP = "supervised fine-tuning (LoRA or full) of a trained model on instruction data with the chat template"


def arguments(p) -> None:
    p.add_argument("--config", default=None, help="YAML config (make finetune: configs/tiny-chat.yaml)")
    p.add_argument("--model", default="", help="the base: an MLflow run id, a checkpoint directory or "
                                                "models:/<name>/<version|@alias> (default: the best run of "
                                                "finetune.base_experiment)")
    p.add_argument("--data", default="", help="reviews (the built-in task) or a .jsonl of {src, tgt} or {messages}")
    p.add_argument("--resume", default="", help="run directory or MLflow run id of a fine-tuning run")
    p.add_argument("--dry-run", action="store_true", help="print the layout and exit")
    overrides_argument(p, "section.key=value, e.g. finetune.method=full")


@dataclass
class Base:
    checkpoint: Path  # PaddleNLP weights + config.json
    tokenizer: Path
    uri: str  # lineage: runs:/<run>/checkpoints/checkpoint-<step>, models:/<name>/<version> or the directory
    config: Config | None  # the base run's config (its split rule), when it came from a run


def run(config: Config, model: str = "", data: str = "", dry_run: bool = False) -> int:
    base = resolve_base(config, model)
    return train_run.run(finetune_config(config, base, data), dry_run=dry_run)


def finetune_config(config: Config, base: Base, data: str = "") -> Config:
    """The fine-tuning run's config: CONFIG's training and fine-tuning settings on the base's model."""
    shape = json.loads((base.checkpoint / "config.json").read_text())
    values = [f"model.hidden_size={shape['hidden_size']}", f"model.intermediate_size={shape['intermediate_size']}",
              f"model.num_layers={shape['num_hidden_layers']}",
              f"model.num_attention_heads={shape['num_attention_heads']}",
              f"model.num_key_value_heads={shape.get('num_key_value_heads') or shape['num_attention_heads']}",
              f"model.max_position_embeddings={shape['max_position_embeddings']}",
              f"model.rms_norm_eps={shape.get('rms_norm_eps', config.model.rms_norm_eps)}",
              f"model.rope_theta={shape.get('rope_theta', 10000.0)}", f"model.vocab_size={shape['vocab_size']}",
              f"model.rope_scaling={json.dumps(rope_scaling_of(shape))}",
              f"model.init_from={base.checkpoint}", f"tokenizer.path={base.tokenizer}",
              f"finetune.base={base.uri}", f"finetune.data={data or config.finetune.data or 'reviews'}"]
    if base.config is not None:  # (the same held-out documents as the base's pretraining)
        values += [f"data.split_seed={base.config.data.split_seed}",
                   f"data.validation_fraction={base.config.data.validation_fraction}"]
    return config.with_overrides(values)


def resolve_base(config: Config, model: str) -> Base:
    if model.startswith("models:"):
        return _from_version(config, model)
    if model and Path(model).expanduser().is_dir():
        return _from_directory(Path(model).expanduser().resolve())
    if model:
        return _from_run(config, model)
    if config.model.init_from:
        return _from_directory(Path(config.model.init_from).expanduser().resolve(), config.tokenizer.path)
    return _from_run(config, "")


def _from_directory(path: Path, tokenizer_path: str = "") -> Base:
    """PaddleNLP weights (config.json + model_state / safetensors) or a Hugging Face checkpoint (core/
    hf_checkpoint.py), with its tokenizer: tokenizer.path, else in it, in tokenizer/, beside it (an export's hf/ and
    tokenizer/), or (a run's checkpoint) in the run directory's tokenizer/."""
    if not (path / "config.json").is_file():
        raise ConfigError(f"MODEL={path}: not a model directory (no config.json: PaddleNLP weights saved with "
                          "save_pretrained, a Hugging Face checkpoint, or a run's checkpoint-<step>)")
    given = [Path(tokenizer_path).expanduser().resolve()] if tokenizer_path else []
    for tokenizer in (*given, path, path / "tokenizer", path.parent / "tokenizer", path.parent.parent / "tokenizer"):
        if (tokenizer / "vocab.txt").is_file() or (tokenizer / "tokenizer.json").is_file():
            recorded = path.parent.parent / "config.yaml"
            return Base(path, tokenizer, str(path), load_config(recorded) if recorded.is_file() else None)
    raise ConfigError(f"MODEL={path}: no tokenizer (vocab.txt or tokenizer.json) in it, in its tokenizer/, beside it "
                      "or in its run directory (or set tokenizer.path)")


def _from_run(config: Config, run_id: str, step: int | None = None, uri: str = "") -> Base:
    source_run.quiet_libraries()
    tracking_uri = tracking.tracking_uri(config.tracking)
    tracking.check_reachable(tracking_uri)
    client = tracking.client(tracking_uri)
    try:
        chosen = source_run.select(client, config.finetune.base_experiment, "eval_loss", run_id, step)
    except Exception as exc:  # noqa: BLE001  (ExportError: no such run / experiment / checkpoint)
        raise ConfigError(f"the base model: {exc}" + ("" if run_id else "; train one first (make train), or pass "
                                                      "MODEL=<run id, checkpoint directory or models:/...>")) from None
    kept = rundir.runs_root(config.training) / ".bases" / chosen.run_id
    downloaded = kept / Path(chosen.info.get("artifact", "-")).name
    if chosen.local_checkpoint is None and (downloaded / "config.json").is_file():  # (downloaded before)
        checkpoint, recorded, tokenizer = downloaded, kept / "config.yaml", kept / "tokenizer"
    else:
        checkpoint, recorded, tokenizer = source_run.fetch_inputs(client, chosen, kept)
    print(f"base model: run {chosen.run_id} ({chosen.run_name}), checkpoint-{chosen.step} (eval_loss "
          f"{chosen.metric_value:.4f}): {checkpoint}", flush=True)
    return Base(checkpoint, tokenizer, uri or f"runs:/{chosen.run_id}/checkpoints/checkpoint-{chosen.step}",
                load_config(recorded))


def _from_version(config: Config, uri: str) -> Base:
    """A registered version's source run and the checkpoint it was exported from."""
    client = tracking.client(tracking.tracking_uri(config.tracking))
    version = model_version(client, uri)
    name = uri.split(":/", 1)[1].split("/")[0].split("@")[0]
    return _from_run(config, version.run_id, int(version.tags["checkpoint_step"]),
                     f"models:/{name}/{version.version}")


def main(config: Config, args) -> int:
    if args.resume:  # (the run's recorded config, overrides on top: pipeline/__main__.py verb_config)
        return train_run.run(config, resume=args.resume, dry_run=args.dry_run)
    return run(config, args.model, args.data, args.dry_run)
