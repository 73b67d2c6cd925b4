"""The whole hybrid-parallel layout in one small validated object (the idea of TorchTitan's parallel_dims.py).

Degrees: data (dp) x pipeline (pp) x sharding x tensor (tp) = world size. Ranks are numbered as Paddle fleet's
`CommunicateTopology` numbers them (axis order data, pipe, sharding, model; the model axis varies fastest), so the
coordinates printed by a dry run are the ones fleet will use.
"""
from __future__ import annotations

from dataclasses import dataclass

from core import arithmetic, schedules
from core.errors import ConfigError, require
from core.workarounds import cpu_runtime

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
    pipeline_schedule: str = "1F1B"
    virtual_stages: int = 1
    stage_split: tuple = ()  # decoder layers per pipeline stage (resolved from parallel.stage_layers)
    mode: str = "manual"
    recompute: bool = False

    @classmethod
    def of(cls, p, m, t) -> "ParallelLayout":
        """The layout of config sections parallel (`p`), model (`m`) and tokenizer (`t`: the embedding's rows, for a
        balanced stage split), checked by its own rules (core/config.py Config.layout adds the rules that join it to
        the batch and the machine)."""
        layout = cls(
            device=p.device, dp=p.data, tp=p.tensor, pp=p.pipeline, sharding_stage=p.sharding_stage,
            sharding_degree=p.sharding_degree, micro_batch_size=p.micro_batch_size,
            accumulation_steps=p.accumulation_steps, nnodes=p.nnodes, num_layers=m.num_layers, amp_dtype=p.amp_dtype,
            cpu_threads=p.cpu_threads, pipeline_schedule=p.schedule, virtual_stages=p.virtual_stages,
            stage_split=resolve_stage_split(p, m, t), mode=p.mode, recompute=p.recompute,
        )
        layout._validate()
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
    def bubble_fraction(self) -> float:
        """Idle fraction of a pipeline step for the schedule (core/schedules.py): 1F1B (p-1)/(m+p-1),
        interleaved over v virtual stages (p-1)/(v*m+p-1); m = micro-batches per step."""
        return schedules.analytic_bubble(self.pipeline_schedule, self.pp, self.accumulation_steps, self.virtual_stages)

    @property
    def amp_effective(self) -> bool:
        """Paddle's auto_cast is a silent no-op on CPU (losses are bit-identical to fp32), so AMP only counts on GPU."""
        return bool(self.amp_dtype) and self.device == "gpu"

    @property
    def schedule(self) -> str:
        return self.pipeline_schedule if self.pp > 1 else "none"

    @property
    def uniform_split(self) -> bool:
        return len(set(self.stage_split)) <= 1

    @property
    def name(self) -> str:
        parts = [f"dp{self.dp}"] if self.dp > 1 else []
        parts += [f"tp{self.tp}"] if self.tp > 1 else []
        parts += [f"pp{self.pp}" + (f"v{self.virtual_stages}" if self.virtual_stages > 1 else "")] if self.pp > 1 \
            else []
        parts += [f"sharding{self.sharding_stage}x{self.sharding_degree}"] if self.sharding_stage else []
        name = "-".join(parts) or "single"
        return name + "-semi-auto" if self.mode == "semi_auto" else name

    def coordinates(self, rank: int) -> dict[str, int]:
        dims = {"data": self.dp, "pipe": self.pp, "sharding": self.sharding_degree, "model": self.tp}
        coords = {}
        for axis in reversed(AXES):
            coords[axis] = rank % dims[axis]
            rank //= dims[axis]
        return {axis: coords[axis] for axis in AXES}

    def stage_layers(self, stage: int) -> range:
        """Decoder layers of a pipeline stage (of its first chunk when interleaved: chunk c of stage s holds virtual
        stage c*p + s)."""
        start = sum(self.stage_split[:stage])
        return range(start, start + self.stage_split[stage])

    def stage_boundaries(self) -> list[int]:
        """Paddle's `seg_method` list: the first item of each stage in [embedding, decoder layers..., norm, head]."""
        bounds = [0]
        for layers in self.stage_split[:-1]:
            bounds.append(bounds[-1] + layers + (1 if len(bounds) == 1 else 0))
        return bounds + [self.num_layers + 3]

    def as_params(self) -> dict[str, object]:
        """What MLflow records about the layout (params and tags)."""
        return {
            "layout": self.name, "world_size": self.world_size, "dp": self.dp, "tp": self.tp, "pp": self.pp,
            "sharding_stage": self.sharding_stage, "sharding_degree": self.sharding_degree,
            "micro_batch_size": self.micro_batch_size, "accumulation_steps": self.accumulation_steps,
            "bubble_fraction": round(self.bubble_fraction, 4), "schedule": self.schedule, "nnodes": self.nnodes,
            "virtual_stages": self.virtual_stages, "stage_layers": ",".join(map(str, self.stage_split)),
            "mode": self.mode, "recompute": str(self.recompute).lower(),
            "amp_effective": str(self.amp_effective).lower(),
        }

    def describe(self) -> str:
        lines = [
            f"layout {self.name}: world size {self.world_size} = data {self.dp} x pipeline {self.pp} x sharding "
            f"{self.sharding_degree} x tensor {self.tp}  ({self.nnodes} node(s) x {self.procs_per_node} "
            f"process(es), device {self.device})",
            f"global batch {self.global_batch_size} = micro-batch {self.micro_batch_size} x accumulation "
            f"{self.accumulation_steps} x data {self.dp} x sharding {self.sharding_degree}",
            f"micro-batches per step: {self.accumulation_steps}; pipeline schedule {self.schedule}"
            + (f" over {self.virtual_stages} virtual stages" if self.virtual_stages > 1 else "")
            + f"; bubble fraction {self.bubble_fraction:.4f}",
            f"parallel mode {self.mode}",
            f"sharding stage {self.sharding_stage or 'off'}; amp {self.amp_dtype or 'off'}"
            + (" (inactive on CPU: auto_cast is a no-op there)" if self.amp_dtype and not self.amp_effective else ""),
        ]
        for stage in range(self.pp if self.virtual_stages == 1 else 0):
            layers = self.stage_layers(stage)
            lines.append(f"pipeline stage {stage}: decoder layers "
                         + (f"{layers.start}..{layers.stop - 1}" if len(layers) else "none")
                         + (" + embedding" if stage == 0 else "") + (" + norm, lm head" if stage == self.pp - 1
                                                                       else ""))
        if self.virtual_stages > 1:
            per_chunk = self.num_layers // (self.pp * self.virtual_stages)
            for stage in range(self.pp):
                chunks = [f"{(c * self.pp + stage) * per_chunk}..{(c * self.pp + stage + 1) * per_chunk - 1}"
                          for c in range(self.virtual_stages)]
                lines.append(f"pipeline stage {stage}: decoder layers {' and '.join(chunks)} (one chunk per virtual "
                             "stage)" + (" + embedding" if stage == 0 else "")
                             + (" + norm, lm head" if stage == self.pp - 1 else ""))
        for rank in range(self.world_size):
            c = self.coordinates(rank)
            lines.append(f"rank {rank:4d} (node {rank // self.procs_per_node}): dp {c['data']} pp {c['pipe']} "
                         f"sharding {c['sharding']} tp {c['model']}")
        return "\n".join(lines)

    # -- validation ---------------------------------------------------------------------------------------------------
    def _validate(self) -> None:
        require(self.device in ("cpu", "gpu"), f"parallel.device: {self.device!r} is not allowed; use 'cpu' or 'gpu'")
        require(self.sharding_stage in (0, 1, 2, 3), "parallel.sharding_stage: use 0 (off), 1, 2 or 3")
        require((self.sharding_stage == 0) == (self.sharding_degree == 1),
                "parallel.sharding_degree: must be 1 when parallel.sharding_stage is 0, and >= 2 when sharding is on")
        require(not (self.device == "cpu" and self.sharding_stage >= 2),
                f"parallel.sharding_stage: stage {self.sharding_stage} needs GPUs (gloo has no reduce_scatter and fleet "
                "asserts gpu/xpu); use sharding_stage 1 on CPU or parallel.device=gpu")
        require(self.amp_dtype in ("", "bfloat16", "float16"),
                f"parallel.amp_dtype: {self.amp_dtype!r} is not allowed; use '' (fp32), 'bfloat16' or 'float16'")
        self._validate_schedule()
        self._validate_mode()
        require(self.world_size % self.nnodes == 0,
                f"parallel.nnodes ({self.nnodes}) must divide the world size {self.world_size}")

    def _validate_schedule(self) -> None:
        p, m, v, name = self.pp, self.accumulation_steps, self.virtual_stages, self.pipeline_schedule
        require(name in schedules.SCHEDULES,
                f"parallel.schedule: {name!r} is not allowed; use one of {', '.join(schedules.SCHEDULES)}")
        require(v >= 1, f"parallel.virtual_stages: must be >= 1, got {v}")
        if p == 1:
            require(name == "1F1B" and v == 1, f"parallel.schedule / parallel.virtual_stages: a pipeline schedule "
                    f"needs parallel.pipeline >= 2 (this layout is {self.name})")
            return
        if name == "1F1B":
            require(v == 1, f"parallel.virtual_stages ({v}): the 1F1B schedule runs one model chunk per stage; use "
                    "parallel.schedule=interleaved-1F1B for virtual stages")
            return
        # Paddle 2.6.2 (fleet/model.py) picks the interleaved engine for m >= 2p and the F-then-B engine for
        # p <= m < 2p, and both engines assert p > 2 and an even split of layers over p*v chunks.
        require(v >= 2, f"parallel.virtual_stages: the {name} schedule needs >= 2 model chunks per stage, got {v}")
        # On CPU, core/workarounds/cpu_gloo.py lifts the engine's p > 2 assertion (two stages verified there).
        require(p > 2 or (self.device == "cpu" and name == "interleaved-1F1B"), f"parallel.schedule={name}: Paddle "
                f"2.6.2's {name} engine needs parallel.pipeline > 2 on GPU (\"virtual pipeline must run under pp "
                f"degree > 2\"), got {p}; use 1F1B or more stages")
        require(self.num_layers % (p * v) == 0, f"parallel.schedule={name}: model.num_layers ({self.num_layers}) must "
                f"divide into parallel.pipeline x parallel.virtual_stages = {p * v} equal chunks")
        require(self.uniform_split, f"parallel.stage_layers: {name} splits the layers evenly over the chunks; an "
                f"uneven split {list(self.stage_split)} needs parallel.schedule=1F1B")
        if name == "interleaved-1F1B":
            require(m % p == 0 and m >= 2 * p, f"parallel.accumulation_steps ({m}): interleaved-1F1B needs a multiple "
                    f"of parallel.pipeline ({p}) that is at least 2 x {p} = {2 * p} micro-batches per step")
        else:
            require(p <= m < 2 * p, f"parallel.accumulation_steps ({m}): Paddle runs FThenB only for pipeline <= "
                    f"micro-batches < 2 x pipeline ({p}..{2 * p - 1}); more micro-batches use interleaved-1F1B")
            require(self.device == "gpu", "parallel.schedule=FThenB: Paddle 2.6.2's F-then-B engine deadlocks on "
                    "the CPU (gloo) send/recv; use it with parallel.device=gpu, or interleaved-1F1B")

    def _validate_mode(self) -> None:
        require(self.mode in ("manual", "semi_auto"),
                f"parallel.mode: {self.mode!r} is not allowed; use 'manual' or 'semi_auto'")
        if self.mode == "semi_auto":
            require(self.pp == 1 and self.sharding_stage == 0,
                    f"parallel.mode=semi_auto: this project's semi-automatic mode builds a data x tensor mesh; "
                    f"layout {self.name} uses pipeline or sharding, which need parallel.mode=manual")

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


def resolve_stage_split(parallel, model, tokenizer) -> tuple:
    """parallel.stage_layers -> decoder layers per stage: uniform, balanced by parameter count, or as listed."""
    p, layers, spec = parallel.pipeline, model.num_layers, parallel.stage_layers
    if isinstance(spec, list):
        require(all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in spec) and len(spec) == p
                and sum(spec) == layers, f"parallel.stage_layers: {spec} must list {p} counts of decoder layers "
                f"(one per pipeline stage) that add up to model.num_layers ({layers})")
        require(all(n >= 1 for n in spec[1:-1]), f"parallel.stage_layers: {spec}: a middle stage needs at least one "
                "decoder layer")
        return tuple(spec)
    require(spec in ("uniform", "parameters"), f"parallel.stage_layers: {spec!r} is not allowed; use 'uniform', "
            "'parameters' or a list of decoder layers per stage such as [3, 1]")
    if spec == "uniform" or p == 1:
        require(layers % p == 0, f"model.num_layers ({layers}) must be divisible by parallel.pipeline ({p}) for "
                "parallel.stage_layers=uniform; or list the layers per stage, e.g. parallel.stage_layers=[3, 1]")
        return (layers // p,) * p
    per_layer = arithmetic.layer_parameters(model)
    embedding = arithmetic.embedding_parameters(model, tokenizer)
    return balanced_split([per_layer] * layers, p, first=embedding, last=embedding + model.hidden_size)


def balanced_split(costs: list[float], stages: int, first: float = 0.0, last: float = 0.0) -> tuple:
    """Contiguous split of layers with `costs` into `stages` groups with the smallest slowest group (ties: the most
    even groups, by the sum of squares); `first` and `last` are fixed costs of the first and last stage (embedding;
    norm + LM head + loss). Middle stages get at least one layer."""
    n = len(costs)
    best: dict[tuple[int, int], tuple[float, float, tuple]] = {}

    def solve(stage: int, start: int) -> tuple[float, float, tuple]:
        if (stage, start) in best:
            return best[(stage, start)]
        extra = (first if stage == 0 else 0.0) + (last if stage == stages - 1 else 0.0)
        if stage == stages - 1:
            cost = extra + sum(costs[start:])
            result = (cost, cost * cost, (n - start,))
        else:
            result = (float("inf"), float("inf"), ())
            for end in range(start + (0 if stage == 0 else 1), n - (stages - stage - 2) + 1):
                rest_max, rest_squares, rest = solve(stage + 1, end)
                cost = extra + sum(costs[start:end])
                candidate = (max(cost, rest_max), cost * cost + rest_squares, (end - start,) + rest)
                if candidate[:2] < result[:2]:
                    result = candidate
        best[(stage, start)] = result
        return result

    return solve(0, 0)[2]
