"""`make evaluate MODEL=models:/<name>/<version>|@<alias> [DATA=<corpus>]`: one registered version judged on a fixed
held-out set and a fixed prompt set, recorded in MLflow so that versions can be compared (`make promote`).

    held-out   the validation split of the version's source run's prepared data set, cut as that run cut it
               (same sequence length and blocks: the eval_loss training reported is reproduced), or every document
               of the corpus DATA, prepared with the version's own tokenizer (training/data/)
    loss       token-weighted cross-entropy of the exported full-sequence graph (paddle.inference, as served), and
               its perplexity
    prompts    PROMPTS, greedy, through the served generation path: mean length, distinct-1/2 (unique n-grams over
               all n-grams of all answers) and repetition rate (share of tokens equal to the token before them); the
               answers are a table artifact
    MLflow     an evaluation run (experiment `<registered name>-evaluation`) linked to the version (tags), with the
               held-out set as its dataset input; the headline numbers copied onto the version's tags, per held-out
               set (`eval.<set>.<metric>`) and as the latest (`eval.loss`, ...)
"""
from __future__ import annotations

import hashlib
import json
import math
import time
from pathlib import Path

import numpy as np

from core import exportdir, tracking
from serving.engine import runtime
from core.config import Config, ConfigError

HELP = "a registered version on a fixed held-out set and prompt set, in MLflow"


def arguments(p) -> None:
    from pipeline.runner.cli import config_argument, overrides_argument

    config_argument(p)
    p.add_argument("--model", default="", help="models:/<name>/<version>, models:/<name>@<alias> or a directory")
    p.add_argument("--data", default="", help="a corpus (file, glob or directory) instead of the source run's "
                                              "validation split")
    overrides_argument(p)

PROMPTS = ("人工智能", "这本书", "快递很快，", "价格便宜", "我们今天", "手机很好用", "质量不错，", "服务态度")
NEW_TOKENS = 32
BATCH = 16
HEADLINE = ("eval_loss", "perplexity", "distinct_1", "distinct_2", "repetition_rate", "mean_length", "task_accuracy")


def run(config: Config, model: str, data: str = "") -> dict:
    from core import registry

    if not model:
        raise ConfigError("MODEL=models:/<name>/<version> (or @<alias>): which registered version to evaluate")
    export_dir = registry.resolve(config, model)
    meta = exportdir.read_meta(export_dir)
    uri = tracking.tracking_uri(config.tracking)
    client = tracking.client(uri)
    held_out = held_out_set(config, client, export_dir, meta, data)
    t0 = time.time()
    if "task" in held_out:  # (a fine-tuned model: the loss on the answers, and the task's accuracy)
        loss, tokens = answer_loss(export_dir, held_out["rows"])
        accuracy, graded = task_accuracy(export_dir, held_out["task"],
                                         batch_size=config.serving.generate_batch_size)
        print(f"task accuracy {accuracy:.4f} ({sum(g['correct'] for g in graded)} of {len(graded)} held-out "
              f"examples answered exactly, greedy, through the exported graph)", flush=True)
    else:
        loss, tokens = token_loss(export_dir, held_out["blocks"])
    answers = generate_prompts(export_dir)
    metrics = {"eval_loss": loss, "perplexity": math.exp(loss), **text_metrics(answers)}
    if "task" in held_out:
        metrics["task_accuracy"] = accuracy
    run_id = record(client, uri, meta, held_out, metrics, answers, tokens)
    if "task" in held_out:
        client.log_table(run_id, {k: [g[k] for g in graded] for k in ("prompt", "answer", "expected", "correct")},
                         "task_answers.json")
    tag_version(client, meta, held_out["digest"], metrics, run_id)
    print(f"{meta['registered_model_name']} v{meta['version']} on {held_out['name']} ({tokens:,} tokens, set "
          f"{held_out['digest']}): eval_loss {loss:.4f} (perplexity {math.exp(loss):.1f}); prompts: distinct-1 "
          f"{metrics['distinct_1']:.3f}, distinct-2 {metrics['distinct_2']:.3f}, repetition "
          f"{metrics['repetition_rate']:.3f}, mean length {metrics['mean_length']:.1f}; {time.time() - t0:.1f}s\n"
          f"MLflow evaluation run {run_id}; next: make promote MODEL=models:/{meta['registered_model_name']}/"
          f"{meta['version']}", flush=True)
    return {"run_id": run_id, "digest": held_out["digest"], **metrics}


# -- the held-out set -------------------------------------------------------------------------------------------------
def held_out_set(config: Config, client, export_dir: Path, meta: dict, data: str) -> dict:
    """{name, digest, blocks [N, seq + 1] int64, source}: the content that is evaluated and its identity."""
    from training.data import read

    if data:
        from training.data.prepare import prepare

        prepared = prepare(config.with_overrides(["data.source=files", f"data.files={json.dumps([data])}",
                                                   "data.blend=[]", f"tokenizer.path={export_dir / 'tokenizer'}",
                                                   "data.max_documents=0"]), log=lambda line: None)
        seq = config.training.seq_length
        blocks = np.concatenate([read.split_blocks(prepared.path, prepared.manifest, split, seq)
                                 for split in ("validation", "train")])
        key, name = prepared.manifest["key"], f"corpus {data}"
    elif _fine_tuned(run_dir := _source_run_dir(client, meta)):
        return fine_tuning_held_out(run_dir, export_dir)
    else:
        spec = _source_data(client, meta)
        from core import dataset

        manifest = dataset.load_manifest(spec["path"])
        blocks = read.validation_blocks(Path(spec["path"]), manifest, spec["seq_length"], spec["validation_blocks"])
        key, seq, name = spec["key"], spec["seq_length"], f"the validation split of {Path(spec['path']).name}"
    if not len(blocks):
        raise ConfigError(f"the held-out set ({name}) has no block of {seq + 1} tokens")
    identity = hashlib.sha256(f"{key}:{seq}:{len(blocks)}".encode()).hexdigest()[:16]
    return {"name": name, "digest": identity, "blocks": blocks, "dataset_key": key, "seq_length": seq}


def fine_tuning_held_out(run_dir: Path, export_dir: Path) -> dict:
    """A fine-tuning run's validation examples (the rows it computed eval_loss on, all of them) and its held-out
    task: each example's messages rendered with the export's chat template, and the expected answer."""
    from core import chat
    from core.config import load_config
    from training.finetune import data as sft

    config = load_config(run_dir / "config.yaml")
    rows = np.load(run_dir / "data" / sft.FILE.format(split="validation"))
    task = sft.held_out(config, chat.read(export_dir / "tokenizer"))
    key = hashlib.sha256(rows.tobytes() + json.dumps([t["prompt"] for t in task]).encode()).hexdigest()
    return {"name": f"the held-out examples of {config.finetune.data}", "digest": key[:16], "rows": rows,
            "task": task, "blocks": rows[:, 0], "dataset_key": key, "seq_length": config.training.seq_length}


def _fine_tuned(run_dir: Path) -> bool:
    """The source run is a fine-tuning run (its recorded config says so: Config.fine_tuning)."""
    from core.config import load_config

    return (run_dir / "config.yaml").is_file() and load_config(run_dir / "config.yaml").fine_tuning


def _source_run_dir(client, meta: dict) -> Path:
    return Path(client.get_run(meta["source_run_id"]).data.tags.get(tracking.TAG_RUN_DIR, ""))


def _source_data(client, meta: dict) -> dict:
    """The source run's data/dataset.json (which prepared set it read, and how it cut its validation split)."""
    run_dir = _source_run_dir(client, meta)
    spec_file = run_dir / "data" / "dataset.json"
    if not spec_file.is_file():
        raise ConfigError(f"the source run {meta['source_run_id']} has no prepared data set on this machine "
                          f"({spec_file}): pass DATA=<corpus> to evaluate on a corpus instead")
    return json.loads(spec_file.read_text())


# -- the measurements -------------------------------------------------------------------------------------------------
def token_loss(export_dir: Path, blocks: np.ndarray) -> tuple[float, int]:
    """Token-weighted cross-entropy of the exported graph over blocks (inputs block[:-1], labels block[1:])."""
    predictor = runtime.create_predictor(export_dir)
    total, count = 0.0, 0
    for start in range(0, len(blocks), BATCH):
        batch = blocks[start:start + BATCH]
        summed, n = _loss_sum(predictor, batch[:, :-1], batch[:, 1:], np.ones(batch[:, 1:].shape, dtype=bool))
        total, count = total + summed, count + n
    return total / count, count


def answer_loss(export_dir: Path, rows: np.ndarray) -> tuple[float, int]:
    """Cross-entropy of the exported graph on the answer tokens of fine-tuning examples ([N, 2, L]: input ids,
    labels with -100 where nothing is learned), token-weighted: the eval_loss fine-tuning reports."""
    from training.finetune.data import IGNORE

    predictor = runtime.create_predictor(export_dir)
    total, count = 0.0, 0
    for start in range(0, len(rows), BATCH):
        ids, labels = rows[start:start + BATCH, 0].astype(np.int64), rows[start:start + BATCH, 1]
        summed, n = _loss_sum(predictor, ids, labels, labels != IGNORE)
        total, count = total + summed, count + n
    return total / max(count, 1), count


def _loss_sum(predictor, ids: np.ndarray, labels: np.ndarray, learned: np.ndarray) -> tuple[float, int]:
    """Summed cross-entropy of the exported graph's logits for `ids` at the `learned` positions of `labels`."""
    logits = runtime.predict(predictor, ids).astype(np.float64)
    top = logits.max(axis=-1, keepdims=True)
    logz = np.log(np.exp(logits - top).sum(axis=-1)) + top[..., 0]
    picked = np.take_along_axis(logits, np.where(learned, labels, 0)[..., None], axis=-1)[..., 0]
    return float((logz - picked)[learned].sum()), int(learned.sum())


def task_accuracy(export_dir: Path, task: list[dict], new_tokens: int = 8,
                  batch_size: int = BATCH) -> tuple[float, list[dict]]:
    """Greedy answers of the exported model to the held-out prompts (as the chat route renders them), exact match
    with the expected answer."""
    from serving.engine.exported import ExportedModel
    from serving.protocol import GenerationSettings

    model = ExportedModel(export_dir)
    session = model.cached_session()
    settings = GenerationSettings(max_new_tokens=new_tokens)
    graded = []
    for start in range(0, len(task), batch_size):
        batch = task[start:start + batch_size]
        new = model.generate_batch(session, [model.encode(t["prompt"]) for t in batch], [settings] * len(batch))
        for item, ids in zip(batch, new):
            answer = model.decode(ids).strip()
            graded.append({"prompt": item["prompt"], "answer": answer, "expected": item["answer"],
                           "correct": answer == item["answer"]})
    return sum(g["correct"] for g in graded) / max(len(graded), 1), graded


def generate_prompts(export_dir: Path) -> list[dict]:
    from serving.protocol import GenerationSettings
    from serving.engine.exported import ExportedModel

    model = ExportedModel(export_dir)
    session = model.cached_session() if exportdir.has_cache_programs(export_dir) else None
    prompts = [model.encode(p) for p in PROMPTS]
    settings = [GenerationSettings(max_new_tokens=NEW_TOKENS)] * len(prompts)
    if session is not None:
        new = model.generate_batch(session, prompts, settings)
    else:
        predictor = runtime.create_predictor(export_dir)
        new = [model.generate(lambda ids: runtime.predict(predictor, ids), p, s) for p, s in zip(prompts, settings)]
    return [{"prompt": p, "text": model.decode(ids), "token_ids": [i for i in ids if i != model.eos_id]}
            for p, ids in zip(PROMPTS, new)]


def text_metrics(answers: list[dict]) -> dict:
    def ngrams(ids, n):
        return [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]

    one = [g for a in answers for g in ngrams(a["token_ids"], 1)]
    two = [g for a in answers for g in ngrams(a["token_ids"], 2)]
    repeats = sum(sum(1 for x, y in zip(a["token_ids"], a["token_ids"][1:]) if x == y) for a in answers)
    steps = sum(max(len(a["token_ids"]) - 1, 0) for a in answers)
    return {"distinct_1": len(set(one)) / max(len(one), 1), "distinct_2": len(set(two)) / max(len(two), 1),
            "repetition_rate": repeats / max(steps, 1),
            "mean_length": float(np.mean([len(a["token_ids"]) for a in answers]))}


# -- MLflow -------------------------------------------------------------------------------------------------------
def record(client, uri: str, meta: dict, held_out: dict, metrics: dict, answers: list[dict], tokens: int) -> str:
    from mlflow.entities import Dataset, DatasetInput, InputTag, Metric, Param, RunTag

    name, version = meta["registered_model_name"], str(meta["version"])
    experiment = tracking.experiment_id(client, f"{name}-evaluation", uri)
    tags = {"mlflow.runName": f"evaluate-{name}-v{version}", "pipeline.stage": "evaluate", "model_name": name,
            "model_version": version, "model_uri": f"models:/{name}/{version}", "eval.dataset": held_out["digest"],
            "source_run_id": meta["source_run_id"]}
    run_id = client.create_run(experiment, tags=tags).info.run_id
    now = int(time.time() * 1000)
    client.log_batch(run_id, metrics=[Metric(k, float(v), now, 0) for k, v in metrics.items()],
                     params=[Param("held_out", held_out["name"][:500]), Param("held_out_tokens", str(tokens)),
                             Param("prompts", str(len(PROMPTS))), Param("new_tokens", str(NEW_TOKENS))],
                     tags=[RunTag("mlflow.note.content", f"Evaluation of models:/{name}/{version}")])
    dataset = Dataset(name=f"held-out-{held_out['digest']}", digest=held_out["digest"], source_type="local",
                      source=json.dumps({"uri": held_out["name"]}),
                      profile=json.dumps({"tokens": tokens, "blocks": len(held_out["blocks"]),
                                          "seq_length": held_out["seq_length"], "data_set": held_out["dataset_key"]}))
    tracking.log_dataset_input(client, run_id, DatasetInput(dataset, [InputTag("mlflow.data.context", "evaluation")]))
    client.log_table(run_id, {k: [a[k] for a in answers] for k in ("prompt", "text")}, "generations.json")
    client.set_terminated(run_id, "FINISHED")
    return run_id


def tag_version(client, meta: dict, digest: str, metrics: dict, run_id: str) -> None:
    name, version = meta["registered_model_name"], str(meta["version"])
    for key in [k for k in HEADLINE if k in metrics]:
        value = f"{metrics[key]:.6g}"
        client.set_model_version_tag(name, version, f"eval.{digest}.{key}", value)
        client.set_model_version_tag(name, version, f"eval.{key}", value)
    client.set_model_version_tag(name, version, "eval.dataset", digest)
    client.set_model_version_tag(name, version, "eval.run_id", run_id)


def main(config: Config, args) -> int:
    run(config, args.model, args.data)
    return 0
