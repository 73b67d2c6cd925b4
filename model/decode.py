"""The decode program of export format 2: one token per sequence, over weights fused at export.

Same inputs and outputs as CachedLlamaStep(with_past=True) (export/programs.py lists them), about half its ops: at
batch 1 a decode step is Paddle Inference running the program, ~6 us an op on CPU, so the op count sets the time per
token. What changes against the layer-by-layer step (the tiny model: 267 ops -> 139; export/programs.py also
drops the identity scale paddle.jit.save appends to each output):
- q, k and v are one matmul, the gate and up projections one (their weights concatenated at export);
- each RMSNorm's weight is folded into the matmul after it, and 1/sqrt(head_dim) into the query columns;
- the fused q/k/v columns are ordered by key/value head (its n query heads, its key, its value), so one reshape and
  one split give the query in attention's grouped layout and the key and value in the cache's layout;
- rotary runs once on all of q/k/v: its table holds cos 1 / sin 0 for the value rows, looked up (cos and sin in one
  row) and expanded over the heads once a step, not per layer;
- the mean of squares is a matmul with 1/H that adds eps (addmm), the residual adds are the o/down matmuls' addmm;
- no float32 -> float32 casts; the hidden state is [B, H] (T = 1), gathered from the embedding at once.
The arithmetic is the same up to rounding; export's parity gates compare the program with the dynamic model.
"""
from __future__ import annotations

import math

import numpy as np

import core  # noqa: F401  (zlib before paddle)
import paddle  # noqa: E402

from model.llama import MASKED, rotary_tables  # noqa: E402


def _weight(layer) -> np.ndarray:
    return layer.weight.numpy()


class FusedDecodeStep(paddle.nn.Layer):
    """decode (input_ids [B,1], position_ids [B,1], key_mask [B,P+1], past_keys_0..L-1, past_values_0..L-1) ->
    logits [B,V], new_keys [L,B,Hkv,1,D], new_values [L,B,Hkv,1,D], as CachedLlamaStep(model, with_past=True), and
    (`greedy`, export format 4) each row's argmax [B] int64."""

    def __init__(self, model, greedy: bool = True):
        super().__init__()
        self.greedy = greedy  # (False: format 2-3's outputs, without the argmax)
        cfg = model.config
        llama = model.llama
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.group = self.heads // self.kv_heads  # query heads per key/value head
        self.head_dim = d = cfg.hidden_size // cfg.num_attention_heads
        self.hidden = h = cfg.hidden_size
        self.intermediate = cfg.intermediate_size
        self.layers = len(llama.layers)

        def param(name: str, value: np.ndarray):
            # (set_value, not the Assign initializer: Paddle 2.6's Assign turns the array into a Python list of
            # floats, 4.4 GB and a minute for a 151,936 x 896 embedding; the 0.5B export peaked at 21.9 GB here)
            tensor = self.create_parameter(list(value.shape), dtype="float32",
                                           default_initializer=paddle.nn.initializer.Constant(0.0))
            tensor.set_value(value.astype("float32"))
            self.add_parameter(name, tensor)
            return tensor

        self.embedding = param("embedding", _weight(llama.embed_tokens))
        self.mean_weight = param("mean_weight", np.full([h, 1], 1.0 / h, "float32"))
        self.eps = param("eps", np.full([1], cfg.rms_norm_eps, "float32"))
        self.qkv, self.qkv_bias, self.o, self.gate_up, self.down = [], [], [], [], []
        for index, layer in enumerate(llama.layers):
            attn, mlp = layer.self_attn, layer.mlp
            norm = layer.input_layernorm.weight.numpy()[:, None]
            q = (norm * _weight(attn.q_proj) / math.sqrt(d)).reshape(h, self.kv_heads, self.group, d)
            k = (norm * _weight(attn.k_proj)).reshape(h, self.kv_heads, 1, d)
            v = (norm * _weight(attn.v_proj)).reshape(h, self.kv_heads, 1, d)
            self.qkv.append(param(f"qkv_{index}", np.concatenate([q, k, v], axis=2).reshape(h, -1)))
            if attn.q_proj.bias is not None:  # (Qwen2: q/k/v biases, in the fused columns' order; added by addmm)
                self.qkv_bias.append(param(f"qkv_bias_{index}", np.concatenate([
                    (attn.q_proj.bias.numpy() / math.sqrt(d)).reshape(self.kv_heads, self.group, d),
                    attn.k_proj.bias.numpy().reshape(self.kv_heads, 1, d),
                    attn.v_proj.bias.numpy().reshape(self.kv_heads, 1, d)], axis=1).reshape(1, -1)))
            self.o.append(param(f"o_{index}", _weight(attn.o_proj)))
            norm = layer.post_attention_layernorm.weight.numpy()[:, None]
            self.gate_up.append(param(f"gate_up_{index}",
                                      norm * np.concatenate([_weight(mlp.gate_proj), _weight(mlp.up_proj)], axis=1)))
            self.down.append(param(f"down_{index}", _weight(mlp.down_proj)))
        head = _weight(model.lm_head)
        head = head if head.shape[0] == h else head.T  # ([hidden, vocab]; a transposed head stores [vocab, hidden])
        self.lm_head = param("lm_head", llama.norm.weight.numpy()[:, None] * head)
        # rotary (the tables of CachedLlamaStep): per position, one row per slot of a key/value head's group
        # (n query heads, the key: rotated; the value: cos 1, sin 0)
        cos, sin = (table.numpy() for table in rotary_tables(cfg))
        rotated = self.group + 1
        rows = len(cos)
        self.rotary_table = param("rotary_table", np.concatenate([  # [position, (cos | sin) x slot x D]
            np.concatenate([np.repeat(cos[:, None], rotated, 1), np.ones_like(cos)[:, None]], axis=1),
            np.concatenate([np.repeat(sin[:, None], rotated, 1), np.zeros_like(sin)[:, None]], axis=1)],
            axis=1).reshape(rows, -1))

    def _normalise(self, x):
        """x * rsqrt(mean(x^2) + eps), the RMSNorm without its weight (folded into the next matmul)."""
        return paddle.rsqrt(paddle.addmm(self.eps, paddle.square(x), self.mean_weight)) * x

    def forward(self, input_ids, position_ids, key_mask, past_keys, past_values):
        slots, d = self.group + 2, self.head_dim
        hidden = paddle.gather(self.embedding, input_ids)  # [B, H] (ids [B, 1])
        cos, sin = paddle.split(paddle.gather(self.rotary_table, position_ids).reshape([-1, 2, slots, d]), 2, axis=1)
        bias = paddle.scale(key_mask, -MASKED, MASKED).unsqueeze([1, 2])  # [B, 1, 1, P+1]: 0 real, MASKED pad
        keys_out, values_out = [], []
        for index in range(self.layers):
            qkv = (paddle.addmm(self.qkv_bias[index], self._normalise(hidden), self.qkv[index]) if self.qkv_bias
                   else paddle.matmul(self._normalise(hidden), self.qkv[index])).reshape([-1, self.kv_heads, slots, d])
            if index == 0:  # (once a step: same-shape multiplies after; broadcasting over the heads, a middle axis,
                cos, sin = cos.expand_as(qkv), sin.expand_as(qkv)  # takes Paddle's generic loop, 15% at batch 256)
            qkv = qkv * cos + paddle.roll(qkv, d // 2, axis=-1) * sin
            q, k, v = paddle.split(qkv, [self.group, 1, 1], axis=2)  # [B, Hkv, n, D], [B, Hkv, 1, D] x 2
            keys_out.append(k)
            values_out.append(v)
            scores = paddle.concat([paddle.matmul(q, past_keys[index], transpose_y=True),
                                    paddle.matmul(q, k, transpose_y=True)], axis=-1)  # [B, Hkv, n, P+1]
            past, new = paddle.split(paddle.nn.functional.softmax(scores + bias, axis=-1), [-1, 1], axis=-1)
            context = (paddle.matmul(past, past_values[index]) + new * v).reshape([-1, self.heads * d])
            hidden = paddle.addmm(hidden, context, self.o[index])
            gate, up = paddle.split(paddle.matmul(self._normalise(hidden), self.gate_up[index]), 2, axis=-1)
            hidden = paddle.addmm(hidden, paddle.nn.functional.silu(gate) * up, self.down[index])
        logits = paddle.matmul(self._normalise(hidden), self.lm_head)
        if not self.greedy:
            return logits, paddle.stack(keys_out), paddle.stack(values_out)
        # (export format 4: each row's argmax beside its logits, so that a greedy batch fetches B ids, not B x V floats)
        return logits, paddle.stack(keys_out), paddle.stack(values_out), paddle.argmax(logits, axis=-1)
