"""`make evaluate MODEL=models:/<name>/<version>|@<alias> [DATA=<corpus>]`: one registered version judged on a fixed
held-out set and a fixed prompt set, recorded in MLflow so that versions can be compared (`make promote`). The room
is evaluation/; this verb runs it.

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

import math
import time

from core import exportdir, registry, tracking
from core.config import Config, ConfigError
from evaluation import grading, measures, record
from evaluation.held_out import held_out_set
from pipeline.runner.cli import config_argument, overrides_argument

HELP = "a registered version on a fixed held-out set and prompt set, in MLflow"


def arguments(p) -> None:
    config_argument(p)
    p.add_argument("--model", default="", help="models:/<name>/<version>, models:/<name>@<alias> or a directory")
    p.add_argument("--data", default="", help="a corpus (file, glob or directory) instead of the source run's "
                                              "validation split")
    overrides_argument(p)


def run(config: Config, model: str, data: str = "") -> dict:
    if not model:
        raise ConfigError("MODEL=models:/<name>/<version> (or @<alias>): which registered version to evaluate")
    export_dir = registry.resolve(config, model)
    meta = exportdir.read_meta(export_dir)
    uri = tracking.tracking_uri(config.tracking)
    client = tracking.client(uri)
    held_out = held_out_set(config, client, export_dir, meta, data)
    t0 = time.time()
    if "task" in held_out:  # (a fine-tuned model: the loss on the answers, and the task's accuracy)
        loss, tokens = measures.answer_loss(export_dir, held_out["rows"])
        task = held_out["task"]
        score = grading.task_accuracy(task, measures.greedy_answers(
            export_dir, [t["prompt"] for t in task], batch_size=config.serving.generate_batch_size))
        print(f"task accuracy {score['accuracy']:.4f} ({score['right']} of {score['total']} held-out examples "
              f"answered exactly, greedy, through the exported graph)", flush=True)
    else:
        loss, tokens = measures.token_loss(export_dir, held_out["blocks"])
    answers = measures.generate_prompts(export_dir)
    metrics = {"eval_loss": loss, "perplexity": math.exp(loss), **grading.text_metrics(answers)}
    if "task" in held_out:
        metrics["task_accuracy"] = score["accuracy"]
    run_id = record.record(client, uri, meta, held_out, metrics, answers, tokens)
    if "task" in held_out:
        client.log_table(run_id, {k: [g[k] for g in score["graded"]] for k in ("prompt", "answer", "expected",
                                                                             "correct")}, "task_answers.json")
    record.tag_version(client, meta, held_out["digest"], metrics, run_id)
    print(f"{meta['registered_model_name']} v{meta['version']} on {held_out['name']} ({tokens:,} tokens, set "
          f"{held_out['digest']}): eval_loss {loss:.4f} (perplexity {math.exp(loss):.1f}); prompts: distinct-1 "
          f"{metrics['distinct_1']:.3f}, distinct-2 {metrics['distinct_2']:.3f}, repetition "
          f"{metrics['repetition_rate']:.3f}, mean length {metrics['mean_length']:.1f}; {time.time() - t0:.1f}s\n"
          f"MLflow evaluation run {run_id}; next: make promote MODEL=models:/{meta['registered_model_name']}/"
          f"{meta['version']}", flush=True)
    return {"run_id": run_id, "digest": held_out["digest"], **metrics}


def main(config: Config, args) -> int:
    run(config, args.model, args.data)
    return 0
