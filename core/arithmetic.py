"""The model's arithmetic, in one place: parameters, FLOPs per token, activation and per-device memory bytes.

The layout (stage splits by parameter count), `make plan` (memory and step time of every layout) and the benchmark
(MFU) all read these; tests/unit/test_plan.py checks them by hand. `config` is a core.config.Config, `layout` a
core.layout.ParallelLayout (neither module is imported here: both import this one).

Memory per device (bytes; the most loaded device: the first stage for activations, the last for the logits):
- weights N (`parameters`), split over tensor x pipeline ranks: n = N / (tp * pp);
- parameters and gradients: n x 2 bytes with AMP (bf16/fp16, only on GPU: auto_cast is a no-op on CPU), n x 4 in fp32;
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
  micro-batches) micro-batches in flight on the first stage;
- the fp32 logits of one micro-batch and the softmax the cross entropy keeps: 2*s*b*V*4/tp on the last stage (on CPU,
  where tensor parallel gathers the logits instead, s*b*V*4*(1/tp + 2) when tp > 1).
FLOPs per trained token: 6 x (weights without the input embedding) + 12 L h s (PaLM, appendix B: forward and
backward, attention scores included), plus recompute's extra forward: full = 2 N, full_attn = 2 N_attn + 4 L s h,
core_attn = 4 L s h.
"""
from __future__ import annotations


def kv_dim(m) -> int:
    return m.hidden_size * m.num_key_value_heads // m.num_attention_heads


def attention_parameters(m) -> int:
    """q, o (h x h) and k, v (h x kv) of one decoder layer."""
    return 2 * m.hidden_size * m.hidden_size + 2 * m.hidden_size * kv_dim(m)


def layer_parameters(m) -> int:
    """One decoder layer: attention, the SwiGLU MLP (3 h x i) and its two RMS norms."""
    return attention_parameters(m) + 3 * m.hidden_size * m.intermediate_size + 2 * m.hidden_size


def vocabulary(m, t, vocab_size: int | None = None) -> int:
    """The embedding's rows: `vocab_size`, else model.vocab_size (an imported model's), else the tokenizer's
    configured maximum (a BPE's vocab_size, a character vocabulary's max_vocab_size). `m`, `t`: the config's model
    and tokenizer sections."""
    return vocab_size or m.vocab_size or (t.vocab_size if t.kind == "bpe" else t.max_vocab_size)


def parameters(m, t, vocab_size: int | None = None) -> int:
    """Llama weights (`m`, `t`: the model and tokenizer sections): decoder layers (with Qwen2's q/k/v biases), the
    embedding and the untied LM head (vocabulary: `vocabulary`) and the final norm."""
    vocab = vocabulary(m, t, vocab_size)
    biases = (m.hidden_size + 2 * kv_dim(m)) * m.num_layers if m.attention_bias else 0
    return m.num_layers * layer_parameters(m) + biases + 2 * vocab * m.hidden_size + m.hidden_size


def embedding_parameters(m, t, vocab_size: int | None = None) -> int:
    return vocabulary(m, t, vocab_size) * m.hidden_size


def flops_per_token(config, vocab_size: int | None = None) -> float:
    """Training FLOPs per token, forward + backward: 6 N' + 12 L h s, N' = weights without the input embedding."""
    m, t = config.model, config.tokenizer
    weights = parameters(m, t, vocab_size) - embedding_parameters(m, t, vocab_size)
    return 6 * weights + 12 * m.num_layers * m.hidden_size * config.training.seq_length


def decode_flops_per_token(m, vocab_size: int, past: int) -> float:
    """FLOPs of generating one token (`m`: the model section, `vocab_size` its embedding's rows) over `past` cached
    positions: 2 N' (a multiply-add per weight, N' without the input embedding) + 4 L h P (the scores and the
    weighted values)."""
    weights = parameters(m, None, vocab_size) - embedding_parameters(m, None, vocab_size)
    return 2 * weights + 4 * m.num_layers * m.hidden_size * past


def recompute_flops_per_token(config, layout) -> float:
    """The extra forward recompute costs per trained token: full = the whole forward (2N), full_attn = the
    attention weights' forward (2 N_attn) and scores (4 L s h), core_attn = the scores only (4 L s h)."""
    if not layout.recompute:
        return 0.0
    m, s = config.model, config.training.seq_length
    scores = 4 * m.num_layers * s * m.hidden_size
    granularity = config.performance.recompute_granularity
    if granularity == "full":
        return 2 * parameters(config.model, config.tokenizer)
    if granularity == "full_attn":
        return 2 * m.num_layers * attention_parameters(m) + scores
    return scores


def value_bytes(layout) -> int:
    """Bytes of a parameter, gradient or activation value: 2 under effective AMP (bf16/fp16 on GPU), else 4."""
    return 2 if layout.amp_effective else 4


def layer_activations(config, layout) -> tuple[float, float]:
    """(bytes kept, bytes recomputed) per decoder layer for one micro-batch, in Korthikanti et al.'s units of s*b*h
    2-byte values (see the module docstring)."""
    m, perf, s, b = config.model, config.performance, config.training.seq_length, layout.micro_batch_size
    h, a, t = m.hidden_size, m.num_attention_heads, layout.tp
    unit = s * b * h * value_bytes(layout) / 2  # (fp32 activations, as on CPU, take twice as many bytes)
    shared = 1 / t if perf.sequence_parallel and t > 1 else 1
    norms, attention, mlp = 4 * shared, 3 * shared + 8 / t, 3 * shared + 16 / t
    scores = 0.0 if perf.flash_attention else 5 * a * s / (h * t)
    everything = norms + attention + scores + mlp
    if not layout.recompute:
        return unit * everything, 0.0
    kept = {"full": 2 * shared, "full_attn": norms + mlp, "core_attn": norms + attention + mlp}[
        perf.recompute_granularity]
    return unit * kept, unit * (everything - kept)


def memory_per_device(config, layout) -> dict[str, float]:
    """Bytes per device of the most loaded device, by part, and their total."""
    width = value_bytes(layout)
    n = parameters(config.model, config.tokenizer) / (layout.tp * layout.pp)
    shard, stage = layout.sharding_degree, layout.sharding_stage
    params = n * width / (shard if stage >= 3 else 1)
    grads = n * width / (shard if stage >= 2 else 1)
    optimizer = n * (12 if width == 2 and config.parallel.amp_level == "O2" else 8) / shard
    layers = config.model.num_layers // layout.pp
    kept, recomputed = layer_activations(config, layout)
    in_flight = min(layout.pp, layout.accumulation_steps)
    if layout.recompute:
        # every pp_recompute_interval-th layer is recomputed (pipeline only); one layer's recomputed part is live
        rc_layers = -(-layers // config.performance.pp_recompute_interval) if layout.pp > 1 else layers
        activations = (kept * rc_layers + (kept + recomputed) * (layers - rc_layers)) * in_flight + recomputed
    else:
        activations = (kept + recomputed) * layers * in_flight
    one = config.training.seq_length * layout.micro_batch_size * vocabulary(config.model, config.tokenizer) * 4
    tp = layout.tp
    logits = one * (1 / tp + 2) if tp > 1 and layout.device == "cpu" else 2 * one / tp
    total = params + grads + optimizer + activations + logits
    return {"parameters": params, "gradients": grads, "optimizer": optimizer, "activations": activations,
            "logits": logits, "total": total}
