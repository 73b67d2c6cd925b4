"""PaddleNLP 2.8.1's Llama on Paddle 2.6.2's CPU kernels: four hot spots, replaced by ops that compute the same values.

Measured on the default config's shapes ([32, 64] tokens, hidden 128, 4 heads of 32, vocabulary 4608; 2 threads,
AMD EPYC), forward + backward:

1. LlamaRMSNorm's `pow(x, 2)`: Paddle's CPU pow kernel takes 3.3 ms for [32, 64, 128] against 0.03 ms for `square`
   (9 norms a step, twice with the gradient: ~60 ms of a ~400 ms step). `square` is also exact (correctly rounded,
   as x*x); Paddle's eager pow is 1 ulp off on ~4% of elements, so an eager norm's output moves by that ulp.
2. `rotate_half` (two slices, a negation and a concat, and their gradients): 8.1 ms for one [32, 64, 4, 32] tensor,
   8 a step. `roll(x, D/2)` is the same concatenation of halves without the sign (0.6 ms); the sign goes into `sin`
   (-x2 * s == x2 * -s exactly).
3. rotary `q * cos` with cos [B, T, 1, D] against q [B, T, H, D]: broadcasting along a middle axis takes Paddle's
   generic broadcast loop (3.2 ms with the gradient) where cos expanded to q's shape first is a same-shape multiply
   (0.7 ms); 16 such products a step.
4. The loss's `astype("float32")` of float32 logits copies [B, T, V] (9.4M floats; ~15 ms each way on this machine's
   memory bandwidth).

The rotary and the loss give PaddleNLP's values and gradients bit for bit; the norm differs only by pow's ulp
(tests/unit/test_cpu_llama_ops.py). Compiled training (dy2static_fix) uses `square` as well. Together: the default
config's compiled step ~430 -> ~340 ms here (docs/benchmarks.md). `apply()` runs where training/model.py builds or
loads a model for CPU (manual parallel; the semi-automatic API's sharded tensors are left to PaddleNLP's code); GPU
runs keep PaddleNLP's code and its fused kernels (config.performance). `PIPELINE_CPU_LLAMA_OPS=off` leaves
PaddleNLP alone (before/after benchmarks: bench/training_speed.py).
"""
from __future__ import annotations

import os

OFF_ENV = "PIPELINE_CPU_LLAMA_OPS"
_ORIGINAL: dict = {}


def enabled(environ=os.environ) -> bool:
    return environ.get(OFF_ENV, "auto") != "off"


def apply() -> bool:
    """Install the replacements (idempotent). Returns whether they are in place."""
    if not enabled():
        return False
    if _ORIGINAL:
        return True
    import paddlenlp.transformers.llama.modeling as llama

    _ORIGINAL.update(rms_forward=llama.LlamaRMSNorm.forward, apply_rotary_pos_emb=llama.apply_rotary_pos_emb,
                     criterion_forward=llama.LlamaPretrainingCriterion.forward)
    llama.LlamaRMSNorm.forward = _rms_norm_forward
    llama.apply_rotary_pos_emb = _apply_rotary_pos_emb
    llama.LlamaPretrainingCriterion.forward = _criterion_forward
    return True


def restore() -> None:
    """PaddleNLP's own code again (tests compare the two)."""
    if not _ORIGINAL:
        return
    import paddlenlp.transformers.llama.modeling as llama

    llama.LlamaRMSNorm.forward = _ORIGINAL["rms_forward"]
    llama.apply_rotary_pos_emb = _ORIGINAL["apply_rotary_pos_emb"]
    llama.LlamaPretrainingCriterion.forward = _ORIGINAL["criterion_forward"]
    _ORIGINAL.clear()


def _float32(x):
    import paddle

    return x if x.dtype == paddle.float32 else x.astype("float32")


def normalise(x, eps: float):
    """RMSNorm before its weight, with `square` (1). Also the norm of compiled training (dy2static_fix) and of the
    export's programs (training/kv_cache.py)."""
    import paddle

    x = x.astype("float32")  # (a copy, as PaddleNLP's: the gradient then sums in the same order, bit for bit)
    return paddle.rsqrt(paddle.square(x).mean(-1, keepdim=True) + eps) * x


def signed_sin(sin):
    """sin with the sign of rotate_half's first half folded in (2): rotate_half(x) * sin == roll(x, D/2) * this."""
    import paddle

    half = sin.shape[-1] // 2
    return paddle.concat([-sin[..., :half], sin[..., half:]], axis=-1)


def rotate(x, cos, signed_sin):
    """x * cos + rotate_half(x) * sin (2, 3); the tables broadcast to x's shape (a head axis of 1, say)."""
    import paddle

    return x * cos.expand_as(x) + paddle.roll(x, x.shape[-1] // 2, axis=-1) * signed_sin.expand_as(x)


def _rms_norm_forward(self, hidden_states):
    """LlamaRMSNorm.forward without the fused kernel, as PaddleNLP computes it (1, 4)."""
    import paddle

    if self.config.use_fused_rms_norm:
        return _ORIGINAL["rms_forward"](self, hidden_states)
    if paddle.in_dynamic_mode():
        with paddle.amp.auto_cast(False):
            hidden_states = normalise(hidden_states, self.variance_epsilon)
    else:
        hidden_states = normalise(hidden_states, self.variance_epsilon)
    if self.weight.dtype in [paddle.float16, paddle.bfloat16]:
        hidden_states = paddle.cast(hidden_states, self.weight.dtype)
    return hidden_states * self.weight


def _apply_rotary_pos_emb(q, k, cos, sin, position_ids):
    """q * cos + rotate_half(q) * sin, as PaddleNLP's apply_rotary_pos_emb (2, 3)."""
    import paddle

    if position_ids is None:
        cos, sin = cos[:, : q.shape[1], :, :], sin[:, : q.shape[1], :, :]  # [1, T, 1, D]
    else:
        cos, sin = cos.squeeze(axis=[0, 2]), sin.squeeze(axis=[0, 2])  # [T, D]
        cos, sin = cos[position_ids].unsqueeze(2), sin[position_ids].unsqueeze(2)  # [B, T, 1, D]
    sin = signed_sin(sin)
    return rotate(q, cos, sin), rotate(k, cos, sin)


def _criterion_forward(self, prediction_scores, masked_lm_labels):
    """LlamaPretrainingCriterion.forward for the plain cross entropy, without copying float32 logits (4)."""
    import paddle

    if self.enable_parallel_cross_entropy or self.config.sep_parallel_degree > 1:
        return _ORIGINAL["criterion_forward"](self, prediction_scores, masked_lm_labels)
    with paddle.amp.auto_cast(False):
        masked_lm_loss = self.loss_func(_float32(prediction_scores), masked_lm_labels.unsqueeze(2))
        masked_lm_loss = masked_lm_loss[masked_lm_loss > 0]  # skip ignore_index, whose loss is 0
        loss = paddle.mean(masked_lm_loss)
    return loss
