"""`make bench` section `decode`: the decode program of export format 2 (model/decode.py, fused weights) against
format 1's (model/llama.py CachedLlamaStep, layer by layer), both saved in this run from one random model of the
default config's shape (the time of a step does not depend on the weights' values): ops a step, and the program's
step time and tokens/s at batch 1, 8, 64 and 256 over 64 cached positions, with one math thread (a serving
worker's), the two formats interleaved in rounds. Step time as Paddle Inference runs it (feed, run, fetch), without
the scheduler and the sampler. `random_model` and `decode_times` also serve the size sweep (bench/size_sweep.py)."""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np

from bench import between_trials, spread
from core.config import DEFAULT_CONFIG, load_config
from core.hf_checkpoint import paddle_rope
from core.hf_checkpoint import rope_scaling as rope_scaling_object
from serving.engine import runtime

BATCHES = (1, 8, 64, 256)
PAST = 64
DEFAULT_VOCAB = 4608  # (the default corpus's vocabulary as `make all` builds it; not read from the served export)


def random_model(hidden: int, layers: int, heads: int, intermediate: int, vocab: int, max_positions: int,
                 kv_heads: int = 0, seed: int = 0, varied_norms: bool = False, rope_theta: float = 10000.0,
                 rope_scaling: dict | None = None, attention_bias: bool = False):
    """A random Llama of this shape; `varied_norms`: its norm weights drawn from [0.5, 1.5) instead of all 1 (the
    decode program folds them into its matmuls: tests/unit/test_export_programs.py checks that)."""
    import core  # noqa: F401  (zlib before paddle)
    import paddle
    from paddlenlp.transformers import LlamaConfig, LlamaForCausalLM

    from model.llama import apply_architecture

    apply_architecture()
    paddle.seed(seed)
    model = LlamaForCausalLM(LlamaConfig(attention_bias=attention_bias,
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads or heads, max_position_embeddings=max_positions,
        rope_theta=rope_theta, **paddle_rope(rope_scaling_object(rope_scaling))))
    for layer in model.llama.layers if attention_bias else ():  # (random, not the zeros they start as)
        for name in ("q_proj", "k_proj", "v_proj"):
            bias = getattr(layer.self_attn, name).bias
            bias.set_value(paddle.randn(bias.shape) * 0.5)
    if varied_norms:
        for norm in [model.llama.norm, *(n for layer in model.llama.layers
                                         for n in (layer.input_layernorm, layer.post_attention_layernorm))]:
            norm.weight.set_value(paddle.rand(norm.weight.shape) + 0.5)
    model.eval()
    return model


def default_model(vocab: int):
    m = load_config(DEFAULT_CONFIG).model
    return random_model(m.hidden_size, m.num_layers, m.num_attention_heads, m.intermediate_size, vocab,
                        m.max_position_embeddings, m.num_key_value_heads)


def decode_times(model, formats: tuple[str, ...], batches: tuple[int, ...], rounds: int, budget_s: float) -> dict:
    """{format: {"ops": n, "batch": {b: {step_ms, tokens_per_s} (median [min-max] over rounds)}}}; each round runs
    every (batch, format) pair for about budget_s / (rounds x pairs) seconds, the formats alternating."""
    from export import programs

    workdir = Path(tempfile.mkdtemp(prefix="bench-decode-"))
    predictors, ops = {}, {}
    for name in formats:
        programs.save_decode(model, workdir / name, fused=name == "format 2")
        ops[name] = programs.op_count(workdir / name)
        predictors[name] = runtime.create_predictor(workdir, prefix=name, threads=1)
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    rng = np.random.default_rng(0)
    samples: dict = {name: {b: [] for b in batches} for name in formats}
    per_pair = budget_s / (rounds * len(batches) * len(formats))
    for round_ in range(rounds):
        for batch in batches:
            inputs = [rng.integers(0, cfg.vocab_size, (batch, 1)), np.full((batch, 1), PAST),
                      np.ones((batch, PAST + 1), "float32"),
                      *(rng.standard_normal((batch, cfg.num_key_value_heads, PAST, head_dim)).astype("float32")
                        for _ in range(2 * cfg.num_hidden_layers))]
            order = formats if round_ % 2 == 0 else formats[::-1]
            for name in order:
                between_trials()
                runtime.run(predictors[name], *inputs)  # (warm: the first run at a shape allocates)
                count, t0 = 0, time.perf_counter()
                while count < 3 or time.perf_counter() - t0 < per_pair:
                    runtime.run(predictors[name], *inputs)
                    count += 1
                samples[name][batch].append((time.perf_counter() - t0) / count)
    return {name: {"ops": ops[name], "batch": {
        b: {"step_ms": spread([s * 1000 for s in samples[name][b]]),
            "tokens_per_s": spread([b / s for s in samples[name][b]])} for b in batches}} for name in formats}


def run(quick: bool, vocab: int = DEFAULT_VOCAB) -> dict:
    formats = ("format 1", "format 2")
    result = decode_times(default_model(vocab), formats, (1, 8) if quick else BATCHES, 1 if quick else 5,
                          2.0 if quick else 40.0)
    result["speedup"] = {b: result["format 1"]["batch"][b]["step_ms"]["median"]
                         / result["format 2"]["batch"][b]["step_ms"]["median"] for b in result["format 2"]["batch"]}
    print(f"[bench] decode: {result['format 1']['ops']} -> {result['format 2']['ops']} ops a step; batch 1 "
          f"{result['format 1']['batch'][1]['step_ms']['median']:.3f} -> "
          f"{result['format 2']['batch'][1]['step_ms']['median']:.3f} ms", flush=True)
    return result


def markdown(r: dict | None) -> list[str]:
    if not r:
        return []
    f1, f2 = r["format 1"], r["format 2"]
    fmt = lambda s, p: f"{s['median']:.{p}f} [{s['min']:.{p}f}-{s['max']:.{p}f}]"  # noqa: E731
    lines = ["", f"### Decode step (the default model's shape, {PAST} cached positions, one math thread, formats "
                 "interleaved)", "", f"Ops a step: format 1 (layer by layer) **{f1['ops']}**, format 2 (fused "
                 f"weights, model/decode.py) **{f2['ops']}**.", "",
             "| batch | format 1 ms | format 2 ms | format 2 tokens/s | speed-up |", "|---|---|---|---|---|"]
    for b in f2["batch"]:
        lines.append(f"| {b} | {fmt(f1['batch'][b]['step_ms'], 3)} | {fmt(f2['batch'][b]['step_ms'], 3)} | "
                     f"{f2['batch'][b]['tokens_per_s']['median']:.0f} | {r['speedup'][b]:.2f}x |")
    return lines
