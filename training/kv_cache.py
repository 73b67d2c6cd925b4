"""The export's static programs over the weights of a PaddleNLP `LlamaForCausalLM`: generation with a key/value
cache as two programs, and the full-sequence graph written with the same layer.

    model    (input_ids [B,T]) -> logits [B,T,V]    (positions 0..T-1, no padding: FullSequence)
    prefill  (input_ids [B,T], position_ids [B,T], key_mask [B,T])
             -> logits of the last position [B,V], keys [L,B,Hkv,T,D], values [L,B,Hkv,T,D]
    decode   (input_ids [B,1], position_ids [B,1], key_mask [B,P+1], past_keys_0..L-1 [B,Hkv,P,D] (one per layer),
              past_values_0..L-1) -> logits [B,V], new_keys [L,B,Hkv,1,D], new_values [L,B,Hkv,1,D]

A decode step costs O(P) attention instead of re-running the whole sequence (the full-sequence graph is
O(P) matmul work per layer *and* O(P^2) attention per token). Sequences of different lengths share a batch by
left padding: `key_mask` is 0 on pads, `position_ids` count real tokens only, so each row computes exactly what it
would alone.

The decode program never copies the cache: it takes each layer's past keys and values as inputs of their own (no
slice of a stacked tensor), attends to the past and to the new token separately (no concatenation of the cache),
and returns only the new token's keys and values (the caller appends them: core/exportdir.py cache_session). The
earlier form (stacked past in, grown caches out) copied the whole cache four times a step inside the program and
once more out of it. Measured with the serving scheduler in process, 64-token greedy requests kept running, 4
interleaved rounds: 1.08x / 1.06x / 1.17x the tokens/s at 1 / 4 / 8 sequences, the same tokens, logits within
1.5e-6 of the earlier form. Exports made with it still serve (cache_session reads either form).

Why this is written out here instead of converting PaddleNLP's own cache path: `LlamaModel.forward` with
`past_key_values` builds its masks and caches with Python control flow that dy2static in Paddle 2.6.2 does not
convert in full-graph mode, and PaddleNLP's inference models (`paddlenlp.experimental.transformers`, the
`GenerationMixin.to_static` path) need GPU-only fused ops. The layer below reuses the model's own sublayers
(embedding, projections, norms' weights, LM head) and is checked against the dynamic model by the export's parity
gate (logits and greedy tokens).
"""
from __future__ import annotations

import math
from pathlib import Path

import core  # noqa: F401  (zlib before paddle)
import paddle  # noqa: E402

from core import exportdir  # noqa: E402
# (the CPU forms of PaddleNLP's norm and rotary: same values, far fewer slow kernels)
from core.workarounds.cpu_llama_ops import normalise, rotate, signed_sin  # noqa: E402

MASKED = -1e9


def _rms_norm(x, weight, eps: float):
    return normalise(x, eps) * weight


class CachedLlamaStep(paddle.nn.Layer):
    def __init__(self, model, with_past: bool, all_positions: bool = False):
        super().__init__()
        self.model = model
        cfg = model.config
        self.with_past, self.all_positions = with_past, all_positions
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        # the same rotary table as LlamaRotaryEmbedding (base 10000, [max_pos, head_dim], halves concatenated)
        inv_freq = 1.0 / (10000 ** (paddle.arange(0, self.head_dim, 2).astype("float32") / self.head_dim))
        freqs = paddle.einsum("i,j->ij", paddle.arange(cfg.max_position_embeddings, dtype="float32"), inv_freq)
        emb = paddle.concat([freqs, freqs], axis=-1)
        self.register_buffer("cos_table", emb.cos())
        self.register_buffer("signed_sin_table", signed_sin(emb.sin()))

    def forward(self, input_ids, position_ids, key_mask, past_keys=None, past_values=None):
        llama = self.model.llama
        # (shapes as tensors and reshape's 0 = "same as the input": batch and lengths are dynamic in the programs)
        length = paddle.shape(input_ids)[1]
        past = paddle.shape(past_keys[0])[2] if self.with_past else paddle.zeros([], "int32")
        hidden = llama.embed_tokens(input_ids)
        cos = paddle.nn.functional.embedding(position_ids, self.cos_table).unsqueeze(2)  # [B, T, 1, D]
        sin = paddle.nn.functional.embedding(position_ids, self.signed_sin_table).unsqueeze(2)
        # additive attention bias [B, 1, T, P+T]: causal over the whole (past + new) sequence, pads masked
        query_at = paddle.arange(length, dtype="int64").unsqueeze(1) + past.astype("int64")
        key_at = paddle.arange(past.astype("int64") + length.astype("int64"), dtype="int64").unsqueeze(0)
        causal = (key_at <= query_at).astype("float32").unsqueeze(0)  # [1, T, P+T]
        allowed = causal * key_mask.astype("float32").unsqueeze(1)  # [B, T, P+T]
        bias = ((1.0 - allowed) * MASKED).unsqueeze(1)
        keys_out, values_out = [], []
        for index, layer in enumerate(llama.layers):
            attn = layer.self_attn
            x = _rms_norm(hidden, layer.input_layernorm.weight, self.eps)
            q = attn.q_proj(x).reshape([0, 0, self.heads, self.head_dim])
            k = attn.k_proj(x).reshape([0, 0, self.kv_heads, self.head_dim])
            v = attn.v_proj(x).reshape([0, 0, self.kv_heads, self.head_dim])
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            k, v = k.transpose([0, 2, 1, 3]), v.transpose([0, 2, 1, 3])  # [B, Hkv, T, D]
            keys_out.append(k)
            values_out.append(v)
            if self.with_past:
                context = self._attend_past_and_new(q, k, v, past_keys[index], past_values[index], bias)
            else:
                context = self._attend(q, k, v, bias)
            hidden = hidden + attn.o_proj(context)
            mlp = layer.mlp
            x = _rms_norm(hidden, layer.post_attention_layernorm.weight, self.eps)
            hidden = hidden + mlp.down_proj(paddle.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
        if self.all_positions:  # (the full-sequence graph: logits [B, T, V])
            return self.model.lm_head(_rms_norm(hidden, llama.norm.weight, self.eps))
        last = _rms_norm(hidden[:, -1:, :], llama.norm.weight, self.eps)
        logits = self.model.lm_head(last)[:, 0, :]
        return logits, paddle.stack(keys_out), paddle.stack(values_out)

    def _attend(self, q, k, v, bias):
        """Attention over k, v [B, Hkv, T, D] (prefill, full sequence): context [B, T, H*D]."""
        if self.kv_heads != self.heads:  # grouped-query attention: each key/value head serves n query heads
            repeat = self.heads // self.kv_heads
            k = k.unsqueeze(2).tile([1, 1, repeat, 1, 1]).reshape([0, self.heads, -1, self.head_dim])
            v = v.unsqueeze(2).tile([1, 1, repeat, 1, 1]).reshape([0, self.heads, -1, self.head_dim])
        scores = paddle.matmul(q.transpose([0, 2, 1, 3]), k, transpose_y=True) / math.sqrt(self.head_dim)
        probs = paddle.nn.functional.softmax(scores + bias, axis=-1)
        return paddle.matmul(probs, v).transpose([0, 2, 1, 3]).reshape([0, 0, self.heads * self.head_dim])

    def _attend_past_and_new(self, q, k, v, past_k, past_v, bias):
        """One new token (decode, T = 1) attending to the cached keys/values [B, Hkv, P, D] and its own k, v
        [B, Hkv, 1, D], without concatenating them: scores over both, one softmax, the two weighted sums added.
        Grouped-query attention groups the query heads of each key/value head ([B, Hkv, n, D]) instead of
        repeating the cache. Context [B, 1, H*D]."""
        q = q.reshape([0, self.kv_heads, -1, self.head_dim])  # [B, 1, H, D] -> [B, Hkv, n, D] (T = 1)
        scores = paddle.concat([paddle.matmul(q, past_k, transpose_y=True), paddle.matmul(q, k, transpose_y=True)],
                               axis=-1) / math.sqrt(self.head_dim)  # [B, Hkv, n, P+1]
        probs = paddle.nn.functional.softmax(scores + bias, axis=-1)  # (bias [B, 1, 1, P+1])
        context = paddle.matmul(probs[:, :, :, :-1], past_v) + probs[:, :, :, -1:] * v  # [B, Hkv, n, D]
        return context.reshape([0, 1, self.heads * self.head_dim])


class FullSequence(paddle.nn.Layer):
    """input_ids [B, T] -> logits [B, T, V]: the full-sequence graph (model.pdmodel), written with the layer of the
    cache programs (positions 0..T-1, no padding) instead of converting PaddleNLP's own forward: dy2static of
    LlamaModel.forward took ~5 s of an export's ~20. The export's parity gate compares it with the dynamic model."""

    def __init__(self, model):
        super().__init__()
        self.step = CachedLlamaStep(model, with_past=False, all_positions=True)

    def forward(self, input_ids):
        positions = paddle.zeros_like(input_ids) + paddle.arange(paddle.shape(input_ids)[1], dtype="int64")
        return self.step(input_ids, positions, paddle.ones_like(input_ids, dtype="float32"))


def save_full_sequence(model, export_dir: Path) -> None:
    full = FullSequence(model)
    full.eval()
    spec = [paddle.static.InputSpec([None, None], "int64", exportdir.FEED_NAME)]
    paddle.jit.save(paddle.jit.to_static(full, input_spec=spec, full_graph=True),
                    str(export_dir / exportdir.MODEL_PREFIX))


def save_programs(model, export_dir: Path) -> None:
    """prefill.pdmodel / decode.pdmodel (+ .pdiparams) next to the full-sequence graph."""
    cfg = model.config
    layers, kv_heads = cfg.num_hidden_layers, cfg.num_key_value_heads
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    ids = paddle.static.InputSpec([None, None], "int64", exportdir.FEED_NAME)
    positions = paddle.static.InputSpec([None, None], "int64", exportdir.POSITIONS_NAME)
    mask = paddle.static.InputSpec([None, None], "float32", exportdir.KEY_MASK_NAME)
    cache = [[paddle.static.InputSpec([None, kv_heads, None, head_dim], "float32", exportdir.past_input(kind, layer))
              for layer in range(layers)] for kind in exportdir.PAST_KINDS]
    for prefix, with_past, spec in ((exportdir.PREFILL_PREFIX, False, [ids, positions, mask]),
                                    (exportdir.DECODE_PREFIX, True, [ids, positions, mask, *cache])):
        step = CachedLlamaStep(model, with_past)
        step.eval()
        static = paddle.jit.to_static(step, input_spec=spec, full_graph=True)
        paddle.jit.save(static, str(export_dir / prefix))
