"""The whole hybrid-parallel layout in one small validated object (the idea of TorchTitan's parallel_dims.py).

Degrees: data (dp) x pipeline (pp) x sharding x tensor (tp) = world size. Ranks are numbered as Paddle fleet's
`CommunicateTopology` numbers them (axis order data, pipe, sharding, model; the model axis varies fastest), so the
coordinates printed by a dry run are the ones fleet will use.
"""
from __future__ import annotations

from dataclasses import dataclass

from typing import TYPE_CHECKING

from pipeline import cpu_runtime
from pipeline.errors import ConfigError, require

if TYPE_CHECKING:  # (the config module imports this one to validate the layout)
    from pipeline.config import Config

AXES = ("data", "pipe", "sharding", "model")


@dataclass(frozen=True)
class ParallelLayout:
    device: str
    dp: int
    tp: int
    pp: int
    sharding_stage: int
    sharding_degree: int
    micro_batch_size: int
    accumulation_steps: int
    nnodes: int
    num_layers: int
    amp_dtype: str
    cpu_threads: int = 0  # as configured; 0 = an even share of the cores (threads_per_rank)

    @classmethod
    def from_config(cls, config: Config) -> "ParallelLayout":
        p, m = config.parallel, config.model
        layout = cls(
            device=p.device, dp=p.data, tp=p.tensor, pp=p.pipeline, sharding_stage=p.sharding_stage,
            sharding_degree=p.sharding_degree, micro_batch_size=p.micro_batch_size,
            accumulation_steps=p.accumulation_steps, nnodes=p.nnodes, num_layers=m.num_layers, amp_dtype=p.amp_dtype,
            cpu_threads=p.cpu_threads,
        )
        layout._validate(config)
        return layout

    # -- derived quantities -------------------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.sharding_degree * self.tp

    @property
    def procs_per_node(self) -> int:
        return self.world_size // self.nnodes

    def threads_per_rank(self) -> int:
        """CPU math threads of each rank on this machine (depends on its cores, so not a frozen property)."""
        return cpu_runtime.threads_per_process(self.cpu_threads, self.procs_per_node)

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.accumulation_steps * self.dp * self.sharding_degree

    @property
    def layers_per_stage(self) -> int:
        return self.num_layers // self.pp

    @property
    def bubble_fraction(self) -> float:
        """Idle fraction of a 1F1B pipeline step: (p - 1) / (m + p - 1), m = micro-batches per step."""
        return (self.pp - 1) / (self.accumulation_steps + self.pp - 1)

    @property
    def amp_effective(self) -> bool:
        """Paddle's auto_cast is a silent no-op on CPU (losses are bit-identical to fp32), so AMP only counts on GPU."""
        return bool(self.amp_dtype) and self.device == "gpu"

    @property
    def schedule(self) -> str:
        # Paddle 2.6.2's eager pipeline is always 1F1B (schedule_mode is only read by the old static pipeline).
        return "1F1B" if self.pp > 1 else "none"

    @property
    def name(self) -> str:
        parts = [f"dp{self.dp}"] if self.dp > 1 else []
        parts += [f"tp{self.tp}"] if self.tp > 1 else []
        parts += [f"pp{self.pp}"] if self.pp > 1 else []
        parts += [f"sharding{self.sharding_stage}x{self.sharding_degree}"] if self.sharding_stage else []
        return "-".join(parts) or "single"

    def coordinates(self, rank: int) -> dict[str, int]:
        dims = {"data": self.dp, "pipe": self.pp, "sharding": self.sharding_degree, "model": self.tp}
        coords = {}
        for axis in reversed(AXES):
            coords[axis] = rank % dims[axis]
            rank //= dims[axis]
        return {axis: coords[axis] for axis in AXES}

    def stage_layers(self, stage: int) -> range:
        return range(stage * self.layers_per_stage, (stage + 1) * self.layers_per_stage)

    def as_params(self) -> dict[str, object]:
        """What MLflow records about the layout (params and tags)."""
        return {
            "layout": self.name, "world_size": self.world_size, "dp": self.dp, "tp": self.tp, "pp": self.pp,
            "sharding_stage": self.sharding_stage, "sharding_degree": self.sharding_degree,
            "micro_batch_size": self.micro_batch_size, "accumulation_steps": self.accumulation_steps,
            "bubble_fraction": round(self.bubble_fraction, 4), "schedule": self.schedule, "nnodes": self.nnodes,
            "amp_effective": str(self.amp_effective).lower(),
        }

    def describe(self) -> str:
        lines = [
            f"layout {self.name}: world size {self.world_size} = data {self.dp} x pipeline {self.pp} x sharding "
            f"{self.sharding_degree} x tensor {self.tp}  ({self.nnodes} node(s) x {self.procs_per_node} "
            f"process(es), device {self.device})",
            f"global batch {self.global_batch_size} = micro-batch {self.micro_batch_size} x accumulation "
            f"{self.accumulation_steps} x data {self.dp} x sharding {self.sharding_degree}",
            f"micro-batches per step: {self.accumulation_steps}; pipeline schedule {self.schedule}; bubble fraction "
            f"(p-1)/(m+p-1) = {self.bubble_fraction:.4f}",
            f"sharding stage {self.sharding_stage or 'off'}; amp {self.amp_dtype or 'off'}"
            + (" (inactive on CPU: auto_cast is a no-op there)" if self.amp_dtype and not self.amp_effective else ""),
        ]
        for stage in range(self.pp):
            layers = self.stage_layers(stage)
            lines.append(f"pipeline stage {stage}: decoder layers {layers.start}..{layers.stop - 1}"
                         + (" + embedding" if stage == 0 else "") + (" + norm, lm head" if stage == self.pp - 1
                                                                       else ""))
        for rank in range(self.world_size):
            c = self.coordinates(rank)
            lines.append(f"rank {rank:4d} (node {rank // self.procs_per_node}): dp {c['data']} pp {c['pipe']} "
                         f"sharding {c['sharding']} tp {c['model']}")
        return "\n".join(lines)

    # -- validation ---------------------------------------------------------------------------------------------------
    def _validate(self, config: Config) -> None:
        m, p = config.model, config.parallel

        require(self.device in ("cpu", "gpu"), f"parallel.device: {self.device!r} is not allowed; use 'cpu' or 'gpu'")
        for key in ("data", "tensor", "pipeline", "sharding_degree", "micro_batch_size", "accumulation_steps",
                    "nnodes", "collective_timeout_s"):
            require(getattr(p, key) >= 1, f"parallel.{key}: must be >= 1, got {getattr(p, key)}")
        require(p.cpu_threads >= 0, f"parallel.cpu_threads: must be >= 0 (0 = an even share of the cores), got "
                f"{p.cpu_threads}")
        require(self.sharding_stage in (0, 1, 2, 3), "parallel.sharding_stage: use 0 (off), 1, 2 or 3")
        require((self.sharding_stage == 0) == (self.sharding_degree == 1),
                "parallel.sharding_degree: must be 1 when parallel.sharding_stage is 0, and >= 2 when sharding is on")
        require(not (self.device == "cpu" and self.sharding_stage >= 2),
                f"parallel.sharding_stage: stage {self.sharding_stage} needs GPUs (gloo has no reduce_scatter and fleet "
                "asserts gpu/xpu); use sharding_stage 1 on CPU or parallel.device=gpu")
        require(self.amp_dtype in ("", "bfloat16", "float16"),
                f"parallel.amp_dtype: {self.amp_dtype!r} is not allowed; use '' (fp32), 'bfloat16' or 'float16'")
        require(p.amp_level in ("O1", "O2"), f"parallel.amp_level: {p.amp_level!r} is not allowed; use 'O1' or 'O2'")
        tp = self.tp
        for key, value in (("num_attention_heads", m.num_attention_heads), ("num_key_value_heads",
                           m.num_key_value_heads), ("hidden_size", m.hidden_size),
                           ("intermediate_size", m.intermediate_size)):
            require(value % tp == 0, f"model.{key} ({value}) must be divisible by parallel.tensor ({tp}); "
                    f"change one of them")
        require(not config.training.compile or (self.tp == 1 and self.pp == 1),
                f"training.compile: the compiled forward supports single-device models only, not tensor/pipeline "
                f"parallel layout {self.name}; set training.compile=false")
        require(m.num_layers % self.pp == 0,
                f"model.num_layers ({m.num_layers}) must be divisible by parallel.pipeline ({self.pp}) so every "
                "stage gets the same number of decoder layers")
        require(self.global_batch_size == config.training.global_batch_size,
                f"training.global_batch_size ({config.training.global_batch_size}) must equal parallel.micro_batch_size "
                f"({self.micro_batch_size}) x parallel.accumulation_steps ({self.accumulation_steps}) x parallel.data "
                f"({self.dp}) x parallel.sharding_degree ({self.sharding_degree}) = {self.global_batch_size}")
        require(self.world_size % self.nnodes == 0,
                f"parallel.nnodes ({self.nnodes}) must divide the world size {self.world_size}")

    def check_fits_machine(self) -> None:
        """Before launch: the processes of this node must fit the devices of this node."""
        if self.device == "gpu":
            import paddle

            available = paddle.device.cuda.device_count() if paddle.is_compiled_with_cuda() else 0
            what = "GPUs"
        else:
            # gloo ranks are plain processes; more than two per core only thrashes (and gloo starts timing out).
            available = 2 * cpu_runtime.available_cores()
            what = "CPU processes (2 per core)"
        if self.procs_per_node > available:
            raise ConfigError(
                f"layout {self.name} needs {self.procs_per_node} processes on this node but only {available} {what} "
                f"are available; lower the parallel degrees or raise parallel.nnodes")
        if self.device == "cpu" and self.cpu_threads:
            cores = cpu_runtime.available_cores()
            if self.procs_per_node * self.cpu_threads > cores:
                raise ConfigError(
                    f"parallel.cpu_threads: {self.procs_per_node} processes x {self.cpu_threads} threads = "
                    f"{self.procs_per_node * self.cpu_threads} > the {cores} cores available here; lower it or use 0 "
                    "(an even share)")


def estimate_parameters(config: Config) -> int:
    """Llama weights for the config, with the vocabulary at its configured maximum (embedding + untied LM head)."""
    m = config.model
    kv_dim = m.hidden_size * m.num_key_value_heads // m.num_attention_heads
    attention = 2 * m.hidden_size * m.hidden_size + 2 * m.hidden_size * kv_dim
    mlp = 3 * m.hidden_size * m.intermediate_size
    return m.num_layers * (attention + mlp + 2 * m.hidden_size) + 2 * config.tokenizer.max_vocab_size * m.hidden_size \
        + m.hidden_size
