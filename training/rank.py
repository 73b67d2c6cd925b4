"""One training process (one rank). Started by `pipeline train`, directly or through `paddle.distributed.launch`.

Reads everything from the run directory the launcher prepared (resolved config, tokenizer, packed data) and trains
with PaddleNLP's Trainer. Rank 0 logs to the MLflow run whose id is in $PIPELINE_MLFLOW_RUN_ID.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path
import json

if __package__ in (None, ""):  # started as a script by paddle.distributed.launch
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import core  # noqa: E402,F401  (loads zlib before paddle: see core/__init__.py)
from core.config import Config, load_config  # noqa: E402
from core.layout import ParallelLayout  # noqa: E402
from core import tracking
from core.files import atomic_write
from core.processes import die_with_parent
from core.tokenizer import load_tokenizer
from training import semi_auto
from training.checkpoint import async_write
from training.checkpoint.local import STOPPED_MARKER
from training.data.read import corpus_blocks, train_dataset, validation_dataset
from training.finetune import data as sft
from training.finetune import dpo, lora, preference
from training.metrics.progress import progress_callback
from training.metrics.stage_timing import StageTimer


def make_trainer(device: str = "cpu", preference=None, **kwargs):
    """PaddleNLP's Trainer with four methods overridden (each an OVERRIDES row, core/workarounds/__init__.py):
    `_get_train_sampler` (the same sample order for every layout, below), `_save_checkpoint` (the pause a checkpoint
    costs, and the checkpoint manager: training/checkpoint/), `_maybe_log_save_evaluate` (the loss window a resume
    continues) and `_wrap_model` (per-stage pipeline timing: training/metrics/stage_timing.py).

    Trainer 2.8.1 shuffles with `BatchSampler` (paddle's global RNG) in a single process but with
    `DistributedBatchSampler` (seeded by the epoch) in a distributed run, so a single-process run and a parallel run
    would see different batches. Always using the distributed sampler makes the global batch of every step the same
    samples whatever the layout, which is what lets the tests compare loss curves across layouts."""
    from paddle.io import DistributedBatchSampler
    from paddlenlp.trainer import Trainer

    class LayoutIndependentTrainer(Trainer):
        def _get_train_sampler(self):
            return DistributedBatchSampler(
                self.train_dataset, batch_size=self.args.per_device_train_batch_size, shuffle=True,
                num_replicas=max(self.args.dataset_world_size, 1), rank=max(self.args.dataset_rank, 0),
                drop_last=self.args.dataloader_drop_last)

        stage_timer = None
        window = None  # the loss window: the running sum since the last log (the loop's tr_loss tensor)
        resumed_window = None  # (a resume: the window its checkpoint saved, added at the first step)

        def _save_checkpoint(self, model, metrics=None):
            # when the loop paused for this checkpoint (training/checkpoint/manager.py logs checkpoint_stall_s)
            import time

            self.state.checkpoint_started_at = time.time()
            before_checkpoint(self.callback_handler.callbacks)
            result = super()._save_checkpoint(model, metrics)
            save_loss_window(self, Path(self.args.output_dir) / f"checkpoint-{self.state.global_step}")
            return result

        def _maybe_log_save_evaluate(self, tr_loss, model, epoch, ignore_keys_for_eval, **kwargs):
            """Also: a checkpoint saved between two logging steps keeps the loss window (its running sum and the
            step it started at), and a resume from it continues that window, so the first loss logged after a
            resume averages the same steps as an uninterrupted run (PaddleNLP restarts the window at the resumed
            step and logs the mean of fewer steps)."""
            self.window = tr_loss
            if self.resumed_window is not None:
                import paddle

                tr_loss.add_(paddle.to_tensor(self.resumed_window["loss_sum"], dtype=tr_loss.dtype))
                self._globalstep_last_logged = self.resumed_window["last_logged"]
                self.resumed_window = None
            return super()._maybe_log_save_evaluate(tr_loss, model, epoch, ignore_keys_for_eval, **kwargs)

        def _wrap_model(self, model, training=True):
            """Also: time the pipeline stages (training/metrics/stage_timing.py) of the engine fleet wraps the model in."""
            from paddle.distributed.fleet.meta_parallel import PipelineParallel

            wrapped = super()._wrap_model(model, training)
            if isinstance(wrapped, PipelineParallel) and self.stage_timer is None:
                self.stage_timer = StageTimer(wrapped, device)
            return wrapped

    if preference is not None:  # (dpo / simpo: the pair loss, its evaluation and metrics, dpo.trainer_class)
        return dpo.trainer_class(LayoutIndependentTrainer, preference)(**kwargs)
    return LayoutIndependentTrainer(**kwargs)


LOSS_WINDOW = "loss_window.json"


def save_loss_window(trainer, checkpoint: Path) -> None:
    """The running loss sum since the last log (averaged over the ranks, as the log averages it) and the step the
    window started at, into the checkpoint (before its completion marker: the writers mark it later)."""
    if trainer.window is None:
        return
    loss_sum = float(trainer._nested_gather(trainer.window).mean())  # (every rank: a collective)
    if trainer.args.process_index == 0:
        checkpoint.mkdir(parents=True, exist_ok=True)
        atomic_write(checkpoint / LOSS_WINDOW, json.dumps({"loss_sum": loss_sum,
                                                           "last_logged": trainer._globalstep_last_logged}))


def resume_loss_window(trainer, checkpoint: str | None) -> None:
    """A resume continues the loss window its checkpoint saved (none saved: PaddleNLP's own restart)."""
    if checkpoint and (Path(checkpoint) / LOSS_WINDOW).is_file():
        trainer.resumed_window = json.loads((Path(checkpoint) / LOSS_WINDOW).read_text())


def prepare_model(config, model):
    """The model as it trains: with training.compile, its forward runs as one static program (model/llama.py)."""
    if config.training.compile:
        from model.llama import compile_forward
        compile_forward(model)
    return model


def training_arguments(config, layout: ParallelLayout, output_dir: Path):
    from paddlenlp.trainer import TrainingArguments

    return TrainingArguments(**training_argument_values(config, layout, output_dir))


# The TrainingArguments that carry config.performance (with the model's LlamaConfig settings: what a dry run shows).
PERFORMANCE_ARGUMENTS = ("amp_master_grad", "tensor_parallel_config", "pipeline_parallel_config",
                         "sharding_parallel_config", "distributed_dataloader", "recompute")


def performance_values(config, layout: ParallelLayout) -> dict:
    """{"LlamaConfig": ..., "TrainingArguments": ...}: the performance settings exactly as they reach PaddleNLP."""
    from model.llama import performance_model_settings

    values = training_argument_values(config, layout, Path("."))
    return {"LlamaConfig": performance_model_settings(config.performance),
            "TrainingArguments": {k: values[k] for k in PERFORMANCE_ARGUMENTS}}


def training_argument_values(config, layout: ParallelLayout, output_dir: Path) -> dict:
    """The keyword arguments of PaddleNLP's TrainingArguments for this config (a plain dict: the translation of
    every setting is testable without the devices it needs)."""
    t, perf = config.training, config.performance
    semi_auto = layout.mode == "semi_auto"
    pipeline_options = []
    if layout.pp > 1 and layout.tp > 1 and layout.device == "cpu":
        # Partial send/recv slices activations over the tensor-parallel group (GPU-only collectives).
        pipeline_options.append("disable_partial_send_recv")
    pipeline_options += [name for name, on in (("enable_dp_comm_overlap", perf.dp_comm_overlap),
                                               ("enable_sharding_comm_overlap", perf.sharding_comm_overlap)) if on]
    return dict(
        output_dir=str(output_dir),
        do_train=True,
        do_eval=True,
        max_steps=t.max_steps,
        # (semi_auto: every rank reads the whole micro-batch of the step; it is sharded over dp as a tensor)
        per_device_train_batch_size=layout.micro_batch_size * (layout.dp if semi_auto else 1),
        gradient_accumulation_steps=layout.accumulation_steps,
        per_device_eval_batch_size=layout.micro_batch_size * layout.accumulation_steps,
        learning_rate=t.learning_rate,
        lr_scheduler_type={"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}[t.lr_scheduler],
        warmup_steps=t.warmup_steps,
        weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm,
        logging_steps=t.logging_interval,
        evaluation_strategy="steps",
        eval_steps=t.eval_interval,
        save_strategy="steps",
        save_steps=t.save_interval,
        metric_for_best_model=config.export.metric,
        greater_is_better=False,
        seed=t.seed,
        dataloader_drop_last=True,
        tensor_parallel_degree=1 if semi_auto else layout.tp,  # semi_auto: the mesh says it (training/semi_auto.py)
        pipeline_parallel_degree=layout.pp,
        pipeline_parallel_config=" ".join(pipeline_options),
        sharding=f"stage{layout.sharding_stage}" if layout.sharding_stage else "",
        sharding_parallel_degree=layout.sharding_degree if layout.sharding_stage else -1,
        recompute=config.parallel.recompute,
        bf16=layout.amp_effective and layout.amp_dtype == "bfloat16",
        fp16=layout.amp_effective and layout.amp_dtype == "float16",
        fp16_opt_level=config.parallel.amp_level,
        amp_master_grad=perf.amp_master_grad,
        tensor_parallel_config="enable_mp_async_allreduce" if perf.mp_async_allreduce else "",
        sharding_parallel_config="split_param" if perf.split_param else "",
        distributed_dataloader=perf.distributed_dataloader,
        # Full (merged) tensors in safetensors: export and resume do not depend on the training layout.
        unified_checkpoint=not semi_auto,
        # PaddleNLP's async branch (host snapshot), written by our writer thread: training/checkpoint/async_write.py
        unified_checkpoint_config="async_save" if async_write.enabled(config.training, layout) else "",
        ignore_save_lr_and_optim=semi_auto,  # see training/semi_auto.py
        device=layout.device,
        no_cuda=layout.device == "cpu",
        disable_tqdm=True,
        report_to=["none"],
        skip_memory_metrics=True,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--resume-from", default="", help="a complete checkpoint directory")
    parser.add_argument("--pending-config", default="",
                        help="resume with this config; it replaces the run's config.yaml after the first step")
    args = parser.parse_args(argv)

    die_with_parent()  # the launcher gone (even by SIGKILL) = SIGTERM here = save and stop, never an orphan
    run_dir = Path(args.run_dir)
    pending = Path(args.pending_config) if args.pending_config else None
    config = load_config(pending or run_dir / "config.yaml")
    layout = config.layout()
    set_up_process(config, layout)

    from paddlenlp.data import default_data_collator

    from training.callbacks import GracefulStop
    # (after the paddlenlp import, which resets SIGTERM to the default action)
    graceful_stop = GracefulStop(run_dir / STOPPED_MARKER)
    train_args = training_arguments(config, layout, run_dir / "checkpoints")
    model, new_trainer = model_and_trainer_class(config, layout, train_args, load_tokenizer(run_dir / "tokenizer"))
    if config.preference_tuning:  # (dpo: the reference's log-probabilities, from the model as it starts)
        preference.ensure_reference(run_dir / "data", dpo.logps_function(model), layout.micro_batch_size,
                                    log=lambda line: print(line, flush=True))
    train_data, eval_data, blocks = datasets(config, run_dir / "data")
    trainer = new_trainer(
        model=model,
        args=train_args,
        train_dataset=train_data,
        eval_dataset=eval_data,
        data_collator=default_data_collator,  # samples are already fixed-length: no padding
        callbacks=callbacks(config, layout, run_dir, pending, graceful_stop, train_args.process_index == 0, blocks),
    )
    for writer in trainer.callback_handler.callbacks:
        if type(writer).__name__ == "StageWriter":  # (the stage timer exists once the Trainer wrapped the model)
            writer.source = lambda: getattr(trainer, "stage_timer", None)
    if hasattr(trainer, "resumed_window"):
        resume_loss_window(trainer, args.resume_from)
    trainer.train(resume_from_checkpoint=args.resume_from or None)
    if getattr(trainer, "stage_timer", None) is not None:
        trainer.stage_timer.write(run_dir)
    if layout.device == "cpu" and layout.world_size > 1:
        from core.workarounds import cpu_gloo

        cpu_gloo.end_process()  # (the gloo layer's point 8: never returns)


def datasets(config: Config, run_data: Path):
    """(training samples, validation samples, training samples per epoch): packed corpus blocks, or a fine-tuning
    run's examples (training/finetune/data.py)."""
    if config.preference_tuning:
        train, evaluation = preference.datasets(run_data, config.training.max_eval_batches *
                                                config.training.global_batch_size)
        return train, evaluation, len(train)
    if config.fine_tuning:
        train = sft.train_dataset(run_data)
        return train, sft.validation_dataset(run_data, config.training.max_eval_batches *
                                             config.training.global_batch_size), len(train)

    return train_dataset(run_data), validation_dataset(run_data), corpus_blocks(run_data)


def set_up_process(config: Config, layout: ParallelLayout) -> None:
    """Device, CPU threads, the world size check and the platform workarounds this process needs."""
    import paddle

    paddle.set_device(layout.device)
    if layout.device == "cpu":
        from core.workarounds import cpu_runtime

        threads = layout.threads_per_rank()
        cpu_runtime.apply_threads(threads)
        print("cpu runtime: " + " ".join(f"{k}={v}" for k, v in cpu_runtime.describe(threads).items()), flush=True)
    world = int(os.environ.get("PADDLE_TRAINERS_NUM", "1"))
    if world != layout.world_size:
        raise SystemExit(f"launched with {world} processes but the layout {layout.name} needs {layout.world_size}")
    if layout.device == "cpu" and world > 1:
        from core.workarounds import cpu_gloo

        cpu_gloo.apply(timeout_s=config.parallel.collective_timeout_s)
    if world == 1:
        from core.workarounds import paddlenlp_resume

        paddlenlp_resume.apply()  # a checkpoint of any layout resumes on one process


def model_and_trainer_class(config: Config, layout: ParallelLayout, train_args, tokenizer):
    """This rank's model (its tensor/pipeline part, or the whole model placed on the semi-auto mesh) and the
    Trainer constructor that fits it."""
    import paddle

    from model.llama import build_model

    paddle.seed(config.training.seed)
    if layout.mode == "semi_auto":
        # The whole model on every rank (same seed or weights), then each weight placed on the [dp, mp] mesh.
        mesh = semi_auto.mesh_2d(layout.dp, layout.tp)
        model = semi_auto.shard_model(build_model(config, tokenizer, 1, 0, pipeline=False), mesh)
        new_trainer = functools.partial(semi_auto.make_trainer, mesh)
    else:
        model = build_model(config, tokenizer, layout.tp, train_args.tensor_parallel_rank, pipeline=layout.pp > 1)
        new_trainer = functools.partial(make_trainer, device=layout.device,
                                        preference=config.finetune if config.preference_tuning else None)
    model = prepare_model(config, model)
    if config.fine_tuning and config.finetune.lora:
        model = lora.wrap(config, model, layout.tp)
    if config.performance.sequence_parallel:
        # As PaddleNLP's llm/run_pretrain.py: the sequence-parallel weights (norms) get their gradients all-reduced
        # over the tensor group.
        from paddlenlp.transformers import register_sequence_parallel_allreduce_hooks

        register_sequence_parallel_allreduce_hooks(model, layout.accumulation_steps, False)
    return model, new_trainer


def callbacks(config: Config, layout: ParallelLayout, run_dir: Path, pending: Path | None, graceful_stop,
              first_process: bool, train_blocks: int) -> list:
    """Stop on a signal (`graceful_stop`), promote a resume's config, measure memory, mark checkpoints complete (and prune, upload), and on the first
    process: MLflow records and the console's progress events."""
    from training.callbacks import FinalStepCallback, PromoteConfig
    from training.metrics.mlflow_logger import MlflowLogger, PeakMemory
    from training.checkpoint import async_write, manager

    monitors = visualdl_writers(config, layout, run_dir, first_process)
    mlflow_logger = None
    run_id = os.environ.get("PIPELINE_MLFLOW_RUN_ID")
    if run_id and first_process:
        mlflow_logger = MlflowLogger(tracking.client(os.environ["MLFLOW_TRACKING_URI"]), run_id,
                                     config.training.seq_length, run_dir,
                                     mirror=monitors[0].add_metrics if monitors and first_process else None)
    import paddle.distributed as dist

    checkpoints = manager.for_rank(config.storage, layout, run_dir, dist.get_rank(), mlflow_logger,
                                   async_save=async_write.enabled(config.training, layout),
                                   upload_mode=config.tracking.checkpoint_artifacts, metric=config.export.metric,
                                   keep=config.training.keep_checkpoints)
    found = [FinalStepCallback(), graceful_stop, PromoteConfig(pending, run_dir / "config.yaml", checkpoints.owner),
             PeakMemory(run_dir, layout.device), checkpoints]
    if mlflow_logger:
        found.append(mlflow_logger)
    found += monitors
    if first_process:
        found.append(progress_callback(run_dir, config.training.seq_length, config.training.global_batch_size,
                                       train_blocks))
    return found


def before_checkpoint(callbacks) -> None:
    """As a checkpoint starts: VisualDL's writers put every step up to it on disk before it can complete (a resume from
    it logs only the steps after it: training/metrics/visualdl_writers.py)."""
    for writer in callbacks:
        if hasattr(writer, "write_before_checkpoint"):
            writer.write_before_checkpoint()


def visualdl_writers(config: Config, layout: ParallelLayout, run_dir: Path, first_process: bool) -> list:
    """VisualDL's writers of this rank (training/metrics/visualdl_writers.py): the run's numbers on the first process,
    a pipeline stage's times on that stage's first replica; none with visualdl.enabled off."""
    if not config.visualdl.enabled:
        return []
    from training.metrics import visualdl_writers as writers

    logdir = run_dir / writers.LOGDIR
    found = []
    if first_process:
        found.append(writers.VisualDLWriter(logdir / "train", writers.hparams(config.model, config.training, config.parallel),
                                            ("train/loss", "eval/loss", "train/tokens_per_second")))
    if layout.pp > 1 and config.parallel.mode != "semi_auto":
        stage = writers.stage_writer_rank()
        if stage is not None:
            found.append(writers.StageWriter(logdir / f"stage-{stage}"))
    return found


if __name__ == "__main__":
    main()
