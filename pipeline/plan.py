"""`make plan`: which layouts fit a model on a cluster, and which is likely fastest, before any GPU-hour is spent.

    python -m pipeline plan --config configs/llama-100b-512gpu.yaml [--top 10] [--csv F] [--write F]
                            [cluster.gpus=512 cluster.gpus_per_node=8 cluster.gpu_memory_gb=80 ...]

The model, all in bytes per device and documented so it can be checked by hand (tests/test_plan.py does):
- weights N (pipeline.layout.estimate_parameters), split over tensor x pipeline ranks: n = N / (tp * pp);
- parameters and gradients: n x 2 bytes with AMP (bf16/fp16), n x 4 in fp32;
- optimizer (AdamW): two fp32 moments, plus an fp32 master copy under AMP O2: n x 8, or n x 12 with O2;
  sharding stage 1 divides the optimizer by the sharding degree, stage 2 also the gradients, stage 3 also the
  parameters;
- activations of one micro-batch (b sequences of s tokens, hidden h, a heads) per decoder layer, after Korthikanti
  et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", Table 2):
  s*b*h*(10 + 24/tp + 5*a*s/(h*tp)) with 2-byte activations, twice that in fp32 (CPU) -- norms 4, attention
  3 + 8/tp + scores 5as/(h tp), MLP 3 + 16/tp; sequence parallelism (performance.sequence_parallel, tp > 1) divides
  the replicated 10 by tp; flash attention drops the scores; with recompute (parallel.recompute) a layer keeps, per
  performance.recompute_granularity: full = its input (2*s*b*h, split by sequence parallelism), full_attn = norms +
  MLP, core_attn = all but the scores, plus one layer's recomputed part while it is recomputed; with pipeline
  parallelism only every performance.pp_recompute_interval-th layer is recomputed; 1F1B keeps min(pp,
  micro-batches) micro-batches in flight on the first stage; the fp32 logits of one micro-batch and the softmax the cross entropy keeps add 2*s*b*V*4/tp on
  the last stage (on CPU, where tensor parallel gathers the logits instead, s*b*V*4*(1/tp + 2) when tp > 1);
- fits when the total is below gpu_memory x (1 - headroom).
Step time (seconds; communication not overlapped unless an overlap option says so): compute (6 N + recompute's extra
forward: 2 N for full, 2 N_attn + 4 L s h for full_attn, 4 L s h for core_attn) x tokens / (gpus x peak x
utilisation), stretched by the pipeline bubble 1 / (1 - (pp-1)/(m+pp-1)); performance.mp_async_allreduce hides
the backward's half of the tensor-parallel all-reduces; dp/sharding_comm_overlap (pipeline > 1) hide the gradient
communication behind the backward (2/3 of compute); sequence parallelism moves the same bytes; tensor parallel: 4
all-reduces per layer per micro-batch of s*b*h*2 bytes, ring volume 2(tp-1)/tp, over the intra-node bandwidth;
pipeline: 2 transfers of s*b*h*2 bytes per micro-batch per stage boundary, over inter-node bandwidth when a stage
boundary crosses nodes; data parallel / sharding: a ring all-reduce of the gradients (2(d-1)/d x gradient bytes)
over the inter-node bandwidth when the group spans nodes, else intra-node; sharding stage 3 also gathers the
parameters for the forward and the backward of every micro-batch (2 m (d-1)/d x parameter bytes).
"""
from __future__ import annotations

import csv
import dataclasses
from dataclasses import dataclass
from pathlib import Path

from pipeline.config import Config, ConfigError, load_config
from pipeline.layout import ParallelLayout, estimate_parameters

GB = 1e9


@dataclass(frozen=True)
class Candidate:
    dp: int
    tp: int
    pp: int
    sharding_stage: int
    sharding_degree: int
    micro_batch_size: int
    accumulation_steps: int
    recompute: bool

    def overrides(self) -> dict:
        return {"data": self.dp, "tensor": self.tp, "pipeline": self.pp, "sharding_stage": self.sharding_stage,
                "sharding_degree": self.sharding_degree, "micro_batch_size": self.micro_batch_size,
                "accumulation_steps": self.accumulation_steps, "recompute": self.recompute}

    @property
    def name(self) -> str:
        shard = f" sh{self.sharding_stage}x{self.sharding_degree}" if self.sharding_stage else ""
        return (f"dp{self.dp} tp{self.tp} pp{self.pp}{shard} mb{self.micro_batch_size}x{self.accumulation_steps}"
                f"{' rc' if self.recompute else ''}")


def with_layout(config: Config, candidate: Candidate) -> Config:
    nodes = max(1, config.cluster.gpus // config.cluster.gpus_per_node)
    parallel = dataclasses.replace(config.parallel, nnodes=nodes, **candidate.overrides())
    return dataclasses.replace(config, parallel=parallel)


def of_config(config: Config) -> Candidate:
    p = config.parallel
    return Candidate(p.data, p.tensor, p.pipeline, p.sharding_stage, p.sharding_degree, p.micro_batch_size,
                     p.accumulation_steps, p.recompute)


def _param_bytes(config: Config) -> int:
    """2 under AMP (bf16/fp16; only on GPU: on CPU auto_cast is a no-op), else 4."""
    return 2 if config.parallel.amp_dtype and config.parallel.device == "gpu" else 4


def memory(config: Config, c: Candidate) -> dict[str, float]:
    """Bytes per device (the most loaded one: first stage for activations, last stage for the logits)."""
    m, s, b = config.model, config.training.seq_length, c.micro_batch_size
    width = _param_bytes(config)
    amp = width == 2
    n = estimate_parameters(config) / (c.tp * c.pp)
    shard = c.sharding_degree if c.sharding_stage else 1
    params = n * width / (shard if c.sharding_stage >= 3 else 1)
    grads = n * width / (shard if c.sharding_stage >= 2 else 1)
    optimizer = n * (12 if amp and config.parallel.amp_level == "O2" else 8) / shard
    layers = m.num_layers // c.pp
    kept, recomputed = layer_activations(config, c)
    in_flight = min(c.pp, c.accumulation_steps)
    if c.recompute:
        # every pp_recompute_interval-th layer is recomputed (pipeline only); one layer's recomputed part is live
        rc_layers = -(-layers // config.performance.pp_recompute_interval) if c.pp > 1 else layers
        activations = (kept * rc_layers + (kept + recomputed) * (layers - rc_layers)) * in_flight + recomputed
    else:
        activations = (kept + recomputed) * layers * in_flight
    one = s * b * config.tokenizer.max_vocab_size * 4
    logits = one * (1 / c.tp + 2) if c.tp > 1 and config.parallel.device == "cpu" else 2 * one / c.tp
    total = params + grads + optimizer + activations + logits
    return {"parameters": params, "gradients": grads, "optimizer": optimizer, "activations": activations,
            "logits": logits, "total": total}


def layer_activations(config: Config, c: Candidate) -> tuple[float, float]:
    """(bytes kept, bytes recomputed) per decoder layer for one micro-batch, in Korthikanti et al.'s units of s*b*h
    2-byte values: layer norms 4, attention 3 + 8/tp + the scores 5*a*s/(h*tp), MLP 3 + 16/tp (10 + 24/tp +
    5as/(h tp) in all, Table 2). Sequence parallelism divides the parts a tensor group replicates (norms 4, attention
    3, MLP 3) by tp; flash attention keeps no scores; recompute keeps, per granularity: full = the layer's input
    (2, split by sequence parallelism), full_attn = norms + MLP, core_attn = all but the scores."""
    m, perf, s, b = config.model, config.performance, config.training.seq_length, c.micro_batch_size
    h, a, t = m.hidden_size, m.num_attention_heads, c.tp
    unit = s * b * h * _param_bytes(config) / 2  # (fp32 activations, as on CPU, take twice as many bytes)
    shared = 1 / t if perf.sequence_parallel and t > 1 else 1
    norms, attention, mlp = 4 * shared, 3 * shared + 8 / t, 3 * shared + 16 / t
    scores = 0.0 if perf.flash_attention else 5 * a * s / (h * t)
    everything = norms + attention + scores + mlp
    if not c.recompute:
        return unit * everything, 0.0
    kept = {"full": 2 * shared, "full_attn": norms + mlp, "core_attn": norms + attention + mlp}[
        perf.recompute_granularity]
    return unit * kept, unit * (everything - kept)


def recompute_flops_per_token(config: Config, c: Candidate) -> float:
    """The extra forward recompute costs per trained token: full = the whole forward (2N), full_attn = the
    attention weights' forward (2 N_attn) and scores (4 L s h), core_attn = the scores only (4 L s h)."""
    if not c.recompute:
        return 0.0
    m, s = config.model, config.training.seq_length
    scores = 4 * m.num_layers * s * m.hidden_size
    granularity = config.performance.recompute_granularity
    if granularity == "full":
        return 2 * estimate_parameters(config)
    if granularity == "full_attn":
        kv = m.hidden_size * m.num_key_value_heads // m.num_attention_heads
        return 2 * m.num_layers * (2 * m.hidden_size ** 2 + 2 * m.hidden_size * kv) + scores
    return scores


def step_time(config: Config, c: Candidate) -> dict[str, float]:
    cl, m, s, b = config.cluster, config.model, config.training.seq_length, c.micro_batch_size
    gpus = c.dp * c.tp * c.pp * c.sharding_degree
    tokens = config.training.global_batch_size * s
    n = estimate_parameters(config)
    micro = c.accumulation_steps
    bubble = (c.pp - 1) / (micro + c.pp - 1)
    flops = 6 * n + recompute_flops_per_token(config, c)
    compute = flops * tokens / (gpus * cl.peak_tflops * 1e12 * cl.utilisation) / (1 - bubble)
    message = s * b * m.hidden_size * 2
    layers = m.num_layers // c.pp
    tensor = 4 * layers * micro * 2 * (c.tp - 1) / c.tp * message / (cl.intra_node_gbps * GB) if c.tp > 1 else 0.0
    crosses_nodes = c.tp * c.pp > cl.gpus_per_node
    pipe_bw = (cl.inter_node_gbps if crosses_nodes else cl.intra_node_gbps) * GB
    pipe = 2 * micro * message / pipe_bw * (c.pp - 1) / c.pp if c.pp > 1 else 0.0
    replicas = c.dp * c.sharding_degree
    grad_bytes = n / (c.tp * c.pp) * _param_bytes(config)
    data_bw = (cl.inter_node_gbps if gpus > cl.gpus_per_node and c.tp * c.pp < gpus else cl.intra_node_gbps) * GB
    data = 2 * (replicas - 1) / replicas * grad_bytes / data_bw if replicas > 1 else 0.0
    if c.sharding_stage >= 3:  # parameters gathered for the forward and again for the backward of every micro-batch
        d = c.sharding_degree
        data += 2 * micro * (d - 1) / d * grad_bytes / data_bw
    perf = config.performance
    if perf.mp_async_allreduce and c.tp > 1:  # the backward's dx all-reduces (half the traffic) hide behind dW
        tensor *= 0.5
    if c.pp > 1 and ((perf.dp_comm_overlap and c.dp > 1) or (perf.sharding_comm_overlap and c.sharding_stage)):
        data = max(0.0, data - compute * 2 / 3)  # gradient communication hidden behind the backward (2/3 of compute)
    return {"compute_s": compute, "tensor_s": tensor, "pipeline_s": pipe, "data_s": data,
            "total_s": compute + tensor + pipe + data, "bubble": bubble}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_layouts(config: Config) -> list[Candidate]:
    """Every layout the config's own validation accepts on the cluster, tensor groups inside a node."""
    cl, gb = config.cluster, config.training.global_batch_size
    found = []
    for tp in _divisors(min(cl.gpus_per_node, cl.gpus)):
        for pp in _divisors(config.model.num_layers):
            if cl.gpus % (tp * pp):
                continue
            rest = cl.gpus // (tp * pp)
            for degree in _divisors(rest):
                for stage in ((0,) if degree == 1 else (1, 2, 3)):
                    for micro in (1, 2, 4, 8):
                        if gb % (micro * rest):
                            continue
                        for recompute in (False, True):
                            c = Candidate(rest // degree, tp, pp, stage, degree, micro, gb // (micro * rest),
                                          recompute)
                            try:
                                ParallelLayout.from_config(with_layout(config, c))
                            except ConfigError:
                                continue
                            found.append(c)
    return found


def rank(config: Config, candidates: list[Candidate]) -> list[dict]:
    budget = config.cluster.gpu_memory_gb * GB * (1 - config.cluster.headroom)
    rows = []
    for c in candidates:
        mem, time = memory(config, c), step_time(config, c)
        rows.append({"layout": c.name, "candidate": c, "fits": mem["total"] <= budget,
                     "memory_gb": mem["total"] / GB, "step_s": time["total_s"], "bubble": time["bubble"],
                     **{f"{k}_gb": v / GB for k, v in mem.items() if k != "total"},
                     **{k: v for k, v in time.items() if k not in ("total_s", "bubble")}})
    return sorted(rows, key=lambda r: (not r["fits"], r["step_s"]))


def breakdown(config: Config, c: Candidate) -> str:
    mem, time = memory(config, c), step_time(config, c)
    budget = config.cluster.gpu_memory_gb * (1 - config.cluster.headroom)
    lines = [f"layout {c.name}: per device", *(f"  {k:<11} {v / GB:8.2f} GB" for k, v in mem.items()),
             f"  -> {'fits' if mem['total'] / GB <= budget else 'does NOT fit'} in {budget:.1f} GB "
             f"({config.cluster.gpu_memory_gb:g} GB x (1 - headroom {config.cluster.headroom:g}))",
             "  step estimate: " + ", ".join(f"{k} {v:.3f}" for k, v in time.items())]
    return "\n".join(lines)


def performance_variants(config: Config, c: Candidate) -> list[tuple[str, dict[str, float]]]:
    """The layout's memory as configured and without flash attention / sequence parallelism (side by side)."""
    perf = config.performance
    variants = [("as configured", perf)]
    for label, changes in (("without flash attention", {"flash_attention": False}),
                           ("without sequence parallelism", {"sequence_parallel": False}),
                           ("without either", {"flash_attention": False, "sequence_parallel": False}),
                           ("with both", {"flash_attention": True, "sequence_parallel": True})):
        variant = dataclasses.replace(perf, **changes)
        if variant != perf and all(variant != v for _, v in variants):
            variants.append((label, variant))
    return [(label, memory(dataclasses.replace(config, performance=v), c)) for label, v in variants]


def run(config_path: str, overrides: list[str], top: int = 10, csv_path: str = "", write: str = "") -> int:
    config = load_config(config_path, overrides)
    cl = config.cluster
    print(f"model: {estimate_parameters(config) / 1e9:.1f}B parameters; cluster: {cl.gpus} GPUs "
          f"({cl.gpus_per_node} per node, {cl.gpu_memory_gb:g} GB)")
    if config.parallel.data * config.parallel.tensor * config.parallel.pipeline * config.parallel.sharding_degree \
            == cl.gpus:
        print("the config's own layout:\n" + breakdown(config, of_config(config)))
        perf = config.performance
        print(f"  activations per device by performance setting (flash_attention={perf.flash_attention}, "
              f"sequence_parallel={perf.sequence_parallel}, recompute={config.parallel.recompute} "
              f"{perf.recompute_granularity if config.parallel.recompute else ''}):")
        for label, mem in performance_variants(config, of_config(config)):
            print(f"    {label:<30} activations {mem['activations'] / GB:8.2f} GB   total {mem['total'] / GB:8.2f} GB")
    dp_only = Candidate(cl.gpus, 1, 1, 0, 1, 1, max(1, config.training.global_batch_size // cl.gpus), False)
    print("data parallel only:\n" + breakdown(config, dp_only))
    rows = rank(config, enumerate_layouts(config))
    fitting = [r for r in rows if r["fits"]]
    print(f"\n{len(rows)} valid layouts, {len(fitting)} fit; the fastest by the step-time estimate:")
    own = next((i for i, r in enumerate(fitting) if r["candidate"] == of_config(config)), None)
    print(f"{'layout':<36} {'GB/device':>9} {'step s':>8} {'bubble':>7}")
    for r in fitting[:top]:
        print(f"{r['layout']:<36} {r['memory_gb']:9.1f} {r['step_s']:8.2f} {r['bubble']:7.3f}")
    if own is not None:
        print(f"the config's own layout ({of_config(config).name}) ranks #{own + 1} of the {len(fitting)} that fit")
    if csv_path:
        with open(csv_path, "w", newline="") as f:
            fields = [k for k in rows[0] if k != "candidate"] if rows else []
            writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
        print(f"all {len(rows)} layouts: {csv_path}")
    if write:
        if not fitting:
            raise ConfigError("no layout fits; nothing to write (more GPUs, more memory, or a smaller model)")
        chosen = with_layout(config, fitting[0]["candidate"])
        Path(write).write_text(chosen.to_yaml(), encoding="utf-8")
        print(f"wrote {write} ({fitting[0]['layout']}); check it with: make train CONFIG={write} DRY_RUN=1")
    return 0 if fitting else 1
