"""Platform workaround: PaddleNLP 2.8.1's Llama under Paddle 2.6.2's dy2static (`paddle.jit.to_static`).

The bug: dy2static mis-transforms the early returns in `LlamaRMSNorm.forward` and `LlamaMLP.forward`
(`NameError: __return_14`), so `paddle.jit.save` of the model fails, and `to_static(full_graph=True)` of a training
forward fails the same way (the default SOT mode instead captures nothing on CPU: "SubgraphNum: 0").
The fix: for the configuration this project builds (no fused kernels, no fused FFN, float32 norm weights) the two
forwards are replaced by their plain equivalents below, for the whole run, by compiled training (`training.compile`).
They are module-level functions because dy2static re-executes their source with the module's globals. (Export no
longer converts PaddleNLP's forward: its three programs come from training/kv_cache.py's own layer.)
"""
from __future__ import annotations

import core  # noqa: F401  (zlib before paddle)
import paddle  # noqa: E402

from core.workarounds import cpu_llama_ops  # noqa: E402

_SQUARE = cpu_llama_ops.enabled()  # (a plain bool: dy2static evaluates the branch below in Python)


def _rms_norm_forward(self, hidden_states):
    # Plain LlamaRMSNorm (no fused kernel, float32 weights) without the early returns dy2static mis-handles; x**2 as
    # `square`, exact and ~100x faster on CPU than Paddle's `pow` (core/workarounds/cpu_llama_ops.py, point 1).
    if _SQUARE:
        normalised = cpu_llama_ops.normalise(hidden_states, self.variance_epsilon)
    else:
        hidden_states = hidden_states.astype("float32")
        normalised = paddle.rsqrt(hidden_states.pow(2).mean(-1, keepdim=True) + self.variance_epsilon) * hidden_states
    return normalised * self.weight


def _mlp_forward(self, x):
    # Plain LlamaMLP (fuse_attention_ffn=False): down(silu(gate(x)) * up(x)).
    return self.down_proj(paddle.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def apply() -> None:
    """Replace the two forwards (for the rest of the process)."""
    from paddlenlp.transformers.llama import modeling

    modeling.LlamaRMSNorm.forward, modeling.LlamaMLP.forward = _rms_norm_forward, _mlp_forward


def compile_forward(model) -> None:
    """Training: run the model's forward as one static program (whole-graph dy2static), the fix applied for good.
    Parameters, state_dict and checkpoints are those of the eager model; only the forward's execution changes."""
    apply()
    model.forward = paddle.jit.to_static(model.forward, full_graph=True)
