"""`make plan`: which layouts fit a model on a cluster, and which is likely fastest, before any GPU-hour is spent.

    python -m pipeline plan --config configs/llama-100b-512gpu.yaml [--top 10] [--csv F] [--write F]
                            [cluster.gpus=512 cluster.gpus_per_node=8 cluster.gpu_memory_gb=80 ...]

Every candidate is a ParallelLayout that the config's own validation accepts on the cluster (tensor groups inside a
node). Memory per device is core/arithmetic.py's model (documented there, checked by hand in tests); a layout fits
when its total is below gpu_memory x (1 - headroom).
Step time (seconds; communication not overlapped unless an overlap option says so): compute (FLOPs per token from
core/arithmetic.py, recompute's extra forward included) x tokens / (gpus x peak x utilisation), stretched by the
layout's pipeline bubble 1 / (1 - bubble) (core/schedules.py: 1F1B (p-1)/(m+p-1), interleaved (p-1)/(v m+p-1));
performance.mp_async_allreduce hides the backward's half of the tensor-parallel all-reduces; dp/sharding_comm_overlap
(pipeline > 1) hide the gradient communication behind the backward (2/3 of compute); sequence parallelism moves the
same bytes; tensor parallel: 4 all-reduces per layer per micro-batch of s*b*h*2 bytes, ring volume 2(tp-1)/tp, over
the intra-node bandwidth; pipeline: 2 transfers of s*b*h*2 bytes per micro-batch per stage boundary, over inter-node
bandwidth when a stage boundary crosses nodes; data parallel / sharding: a ring all-reduce of the gradients
(2(d-1)/d x gradient bytes) over the inter-node bandwidth when the group spans nodes, else intra-node; sharding stage
3 also gathers the parameters for the forward and the backward of every micro-batch (2 m (d-1)/d x parameter bytes).
"""
from __future__ import annotations

import csv
import dataclasses
from pathlib import Path

from core import arithmetic
from core.config import Config, ConfigError
from core.layout import ParallelLayout
from pipeline.runner.cli import config_argument, overrides_argument

HELP = "memory and step-time estimates of every layout of a model on a cluster"


def arguments(p) -> None:
    config_argument(p)
    p.add_argument("--top", type=int, default=10, help="how many fitting layouts to print")
    p.add_argument("--csv", default="", help="write every valid layout, ranked, to this CSV file")
    p.add_argument("--write", default="", help="write the top layout as a config file (check it with DRY_RUN=1)")
    overrides_argument(p, "e.g. cluster.gpus=512 cluster.gpu_memory_gb=80")

GB = 1e9


def with_layout(config: Config, **parallel) -> Config:
    """The config with other parallel degrees (`data=`, `tensor=`, ... as in `parallel:`) on the cluster's nodes. A
    candidate without a pipeline has no pipeline schedule: the config's own (e.g. interleaved) applies only to
    candidates with pipeline >= 2."""
    nodes = max(1, config.cluster.gpus // config.cluster.gpus_per_node)
    if parallel.get("pipeline", config.parallel.pipeline) < 2:
        parallel = {"schedule": "1F1B", "virtual_stages": 1, **parallel}
    return dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, nnodes=nodes, **parallel))


def candidate(config: Config, dp: int, tp: int, pp: int, sharding_stage: int, sharding_degree: int,
              micro_batch_size: int, accumulation_steps: int, recompute: bool) -> ParallelLayout:
    """The layout with these degrees on the cluster, validated as a config would be (ConfigError if not valid)."""
    return with_layout(
        config, data=dp, tensor=tp, pipeline=pp, sharding_stage=sharding_stage, sharding_degree=sharding_degree,
        micro_batch_size=micro_batch_size, accumulation_steps=accumulation_steps, recompute=recompute).layout()


def parallel_settings(layout: ParallelLayout) -> dict:
    """The `parallel:` settings that give this layout."""
    return {"data": layout.dp, "tensor": layout.tp, "pipeline": layout.pp, "sharding_stage": layout.sharding_stage,
            "sharding_degree": layout.sharding_degree, "micro_batch_size": layout.micro_batch_size,
            "accumulation_steps": layout.accumulation_steps, "recompute": layout.recompute}


def label(layout: ParallelLayout) -> str:
    shard = f" sh{layout.sharding_stage}x{layout.sharding_degree}" if layout.sharding_stage else ""
    return (f"dp{layout.dp} tp{layout.tp} pp{layout.pp}{shard} mb{layout.micro_batch_size}x"
            f"{layout.accumulation_steps}{' rc' if layout.recompute else ''}")


def memory(config: Config, layout: ParallelLayout) -> dict[str, float]:
    return arithmetic.memory_per_device(config, layout)


def step_time(config: Config, layout: ParallelLayout) -> dict[str, float]:
    cl, m, s, b = config.cluster, config.model, config.training.seq_length, layout.micro_batch_size
    c = layout
    gpus = c.world_size
    tokens = config.training.global_batch_size * s
    micro = c.accumulation_steps
    bubble = c.bubble_fraction
    flops = arithmetic.flops_per_token(config) + arithmetic.recompute_flops_per_token(config, c)
    compute = flops * tokens / (gpus * cl.peak_tflops * 1e12 * cl.utilisation) / (1 - bubble)
    message = s * b * m.hidden_size * 2
    layers = m.num_layers // c.pp
    tensor = 4 * layers * micro * 2 * (c.tp - 1) / c.tp * message / (cl.intra_node_gbps * GB) if c.tp > 1 else 0.0
    crosses_nodes = c.tp * c.pp > cl.gpus_per_node
    pipe_bw = (cl.inter_node_gbps if crosses_nodes else cl.intra_node_gbps) * GB
    pipe = 2 * micro * message / pipe_bw * (c.pp - 1) / c.pp if c.pp > 1 else 0.0
    replicas = c.dp * c.sharding_degree
    grad_bytes = arithmetic.parameters(config.model, config.tokenizer) / (c.tp * c.pp) * arithmetic.value_bytes(c)
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


def enumerate_layouts(config: Config) -> list[ParallelLayout]:
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
                            try:
                                found.append(candidate(config, rest // degree, tp, pp, stage, degree, micro,
                                                       gb // (micro * rest), recompute))
                            except ConfigError:
                                continue
    return found


def rank(config: Config, layouts: list[ParallelLayout]) -> list[dict]:
    budget = config.cluster.gpu_memory_gb * GB * (1 - config.cluster.headroom)
    rows = []
    for layout in layouts:
        mem, time = memory(config, layout), step_time(config, layout)
        rows.append({"layout": label(layout), "parallel": layout, "fits": mem["total"] <= budget,
                     "memory_gb": mem["total"] / GB, "step_s": time["total_s"], "bubble": time["bubble"],
                     **{f"{k}_gb": v / GB for k, v in mem.items() if k != "total"},
                     **{k: v for k, v in time.items() if k not in ("total_s", "bubble")}})
    return sorted(rows, key=lambda r: (not r["fits"], r["step_s"]))


def breakdown(config: Config, layout: ParallelLayout) -> str:
    mem, time = memory(config, layout), step_time(config, layout)
    budget = config.cluster.gpu_memory_gb * (1 - config.cluster.headroom)
    lines = [f"layout {label(layout)}: per device", *(f"  {k:<11} {v / GB:8.2f} GB" for k, v in mem.items()),
             f"  -> {'fits' if mem['total'] / GB <= budget else 'does NOT fit'} in {budget:.1f} GB "
             f"({config.cluster.gpu_memory_gb:g} GB x (1 - headroom {config.cluster.headroom:g}))",
             "  step estimate: " + ", ".join(f"{k} {v:.3f}" for k, v in time.items())]
    return "\n".join(lines)


def performance_variants(config: Config, layout: ParallelLayout) -> list[tuple[str, dict[str, float]]]:
    """The layout's memory as configured and without flash attention / sequence parallelism (side by side)."""
    perf = config.performance
    variants = [("as configured", perf)]
    for name, changes in (("without flash attention", {"flash_attention": False}),
                          ("without sequence parallelism", {"sequence_parallel": False}),
                          ("without either", {"flash_attention": False, "sequence_parallel": False}),
                          ("with both", {"flash_attention": True, "sequence_parallel": True})):
        variant = dataclasses.replace(perf, **changes)
        if variant != perf and all(variant != v for _, v in variants):
            variants.append((name, variant))
    return [(name, memory(dataclasses.replace(config, performance=v), layout)) for name, v in variants]


def run(config: Config, top: int = 10, csv_path: str = "", write: str = "") -> int:
    cl = config.cluster
    print(f"model: {arithmetic.parameters(config.model, config.tokenizer) / 1e9:.1f}B parameters; cluster: {cl.gpus} GPUs "
          f"({cl.gpus_per_node} per node, {cl.gpu_memory_gb:g} GB)")
    own = config.layout()
    if own.world_size == cl.gpus:
        _print_own_layout(config, own)
    dp_only = candidate(config, cl.gpus, 1, 1, 0, 1, 1, max(1, config.training.global_batch_size // cl.gpus), False) \
        if config.training.global_batch_size % cl.gpus == 0 else None
    if dp_only:
        print("data parallel only:\n" + breakdown(config, dp_only))
    rows = rank(config, enumerate_layouts(config))
    fitting = [r for r in rows if r["fits"]]
    print(f"\n{len(rows)} valid layouts, {len(fitting)} fit; the fastest by the step-time estimate:")
    print(f"{'layout':<36} {'GB/device':>9} {'step s':>8} {'bubble':>7}")
    for r in fitting[:top]:
        print(f"{r['layout']:<36} {r['memory_gb']:9.1f} {r['step_s']:8.2f} {r['bubble']:7.3f}")
    position = next((i for i, r in enumerate(fitting) if r["layout"] == label(own)), None)
    if position is not None:
        print(f"the config's own layout ({label(own)}) ranks #{position + 1} of the {len(fitting)} that fit")
    if csv_path:
        _write_csv(rows, csv_path)
    if write:
        if not fitting:
            raise ConfigError("no layout fits; nothing to write (more GPUs, more memory, or a smaller model)")
        chosen = with_layout(config, **parallel_settings(fitting[0]["parallel"]))
        Path(write).write_text(chosen.to_yaml(), encoding="utf-8")
        print(f"wrote {write} ({fitting[0]['layout']}); check it with: make train CONFIG={write} DRY_RUN=1")
    return 0 if fitting else 1


def _print_own_layout(config: Config, own: ParallelLayout) -> None:
    print("the config's own layout:\n" + breakdown(config, own))
    perf = config.performance
    print(f"  activations per device by performance setting (flash_attention={perf.flash_attention}, "
          f"sequence_parallel={perf.sequence_parallel}, recompute={own.recompute} "
          f"{perf.recompute_granularity if own.recompute else ''}):")
    for name, mem in performance_variants(config, own):
        print(f"    {name:<30} activations {mem['activations'] / GB:8.2f} GB   total {mem['total'] / GB:8.2f} GB")


def _write_csv(rows: list[dict], csv_path: str) -> None:
    with open(csv_path, "w", newline="") as f:
        fields = [k for k in rows[0] if k != "parallel"] if rows else []
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    print(f"all {len(rows)} layouts: {csv_path}")


def main(config: Config, args) -> int:
    return run(config, args.top, args.csv, args.write)
