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
  et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"), no sequence parallelism:
  s*b*h*(10 + 24/tp + 5*a*s/(h*tp)) with 2-byte activations, twice that in fp32 (CPU); with full recompute only
  each layer's input is kept (2*s*b*h, 2-byte) plus one layer's full activations while it is recomputed; 1F1B
  keeps min(pp, micro-batches) micro-batches in flight on the first stage; the fp32 logits of one micro-batch and the softmax the cross entropy keeps add 2*s*b*V*4/tp on
  the last stage (on CPU, where tensor parallel gathers the logits instead, s*b*V*4*(1/tp + 2) when tp > 1);
- fits when the total is below gpu_memory x (1 - headroom).
Step time (seconds, no overlap assumed, which makes it pessimistic): compute 6 N tokens (8 N with recompute) /
(gpus x peak x utilisation), stretched by the pipeline bubble 1 / (1 - (pp-1)/(m+pp-1)); tensor parallel: 4
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
    h, a, layers = m.hidden_size, m.num_attention_heads, m.num_layers // c.pp
    # (bytes for 2-byte activations; fp32 activations, as on CPU, take twice as many)
    full_layer = s * b * h * (10 + 24 / c.tp + 5 * a * s / (h * c.tp)) * width / 2
    in_flight = min(c.pp, c.accumulation_steps)
    if c.recompute:
        activations = width * s * b * h * layers * in_flight + full_layer
    else:
        activations = full_layer * layers * in_flight
    one = s * b * config.tokenizer.max_vocab_size * 4
    logits = one * (1 / c.tp + 2) if c.tp > 1 and config.parallel.device == "cpu" else 2 * one / c.tp
    total = params + grads + optimizer + activations + logits
    return {"parameters": params, "gradients": grads, "optimizer": optimizer, "activations": activations,
            "logits": logits, "total": total}


def step_time(config: Config, c: Candidate) -> dict[str, float]:
    cl, m, s, b = config.cluster, config.model, config.training.seq_length, c.micro_batch_size
    gpus = c.dp * c.tp * c.pp * c.sharding_degree
    tokens = config.training.global_batch_size * s
    n = estimate_parameters(config)
    micro = c.accumulation_steps
    bubble = (c.pp - 1) / (micro + c.pp - 1)
    compute = (8 if c.recompute else 6) * n * tokens / (gpus * cl.peak_tflops * 1e12 * cl.utilisation) / (1 - bubble)
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


def run(config_path: str, overrides: list[str], top: int = 10, csv_path: str = "", write: str = "") -> int:
    config = load_config(config_path, overrides)
    cl = config.cluster
    print(f"model: {estimate_parameters(config) / 1e9:.1f}B parameters; cluster: {cl.gpus} GPUs "
          f"({cl.gpus_per_node} per node, {cl.gpu_memory_gb:g} GB)")
    if config.parallel.data * config.parallel.tensor * config.parallel.pipeline * config.parallel.sharding_degree \
            == cl.gpus:
        print("the config's own layout:\n" + breakdown(config, of_config(config)))
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
