"""An evaluation in MLflow: a run of its own (experiment `<registered name>-evaluation`) linked to the version, with the
held-out set as its dataset input, and the headline numbers copied onto the version's tags, per held-out set
(`eval.<set>.<metric>`) and as the latest (`eval.loss`, ...), which `make promote` compares."""
from __future__ import annotations

import json
import time

from mlflow.entities import Dataset, DatasetInput, InputTag, Metric, Param, RunTag

from core import tracking
from evaluation.measures import NEW_TOKENS, PROMPTS

HEADLINE = ("eval_loss", "perplexity", "distinct_1", "distinct_2", "repetition_rate", "mean_length", "task_accuracy")


def record(client, uri: str, meta: dict, held_out: dict, metrics: dict, answers: list[dict], tokens: int) -> str:
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
