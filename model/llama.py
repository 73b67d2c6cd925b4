"""The model: PaddleNLP 2.8.1's `LlamaForCausalLM` as this project builds, trains, exports and evaluates it. Training
(training/rank.py), export (export/) and evaluation import it from here; serving runs the programs export writes.

    building    llama_config, build_model (single-device, tensor-parallel, or `LlamaForCausalLMPipe` split where
                `parallel.stage_layers` says), load_merged (the portable single-device model of any checkpoint)
    CPU ops     apply_cpu_ops: four of PaddleNLP's Llama functions on Paddle 2.6.2's CPU kernels replaced by ops that
                compute the same values (below); `PIPELINE_CPU_LLAMA_OPS=off` keeps PaddleNLP's code
    compiled    compile_forward: whole-graph dy2static of the training forward, with the two forwards dy2static
                cannot convert replaced (below)
    cached step CachedLlamaStep / FullSequence: the export's prefill, decode and full-sequence programs over the
                model's own sublayers

Why the CPU ops (what each replaces is exact, tests/unit/test_model.py; the speed-up is in docs/benchmarks.md):
1. LlamaRMSNorm's `pow(x, 2)`: Paddle's CPU pow kernel is far slower than `square`, and 1 ulp off on some elements
   (`square` is correctly rounded, as x*x).
2. `rotate_half` (two slices, a negation, a concat and their gradients): `roll(x, D/2)` is the same concatenation of
   halves without the sign; the sign goes into `sin` (-x2 * s == x2 * -s exactly).
3. rotary `q * cos` with cos [B, T, 1, D]: broadcasting along a middle axis takes Paddle's generic broadcast loop;
   cos expanded to q's shape first is a same-shape multiply.
4. The loss's `astype("float32")` of float32 logits copies [B, T, V].
They apply where a model is built or loaded for CPU (manual parallel; the semi-automatic API's sharded tensors keep
PaddleNLP's code); GPU runs keep PaddleNLP's code and its fused kernels (config.performance).

Why the compiled-forward fix: Paddle 2.6.2's dy2static mis-transforms the early returns in `LlamaRMSNorm.forward`
and `LlamaMLP.forward` (`NameError: __return_14`), so `to_static(full_graph=True)` of the training forward fails (the
default SOT mode captures nothing on CPU: "SubgraphNum: 0"). For the configuration this project builds (no fused
kernels, no fused FFN, float32 norm weights) they are replaced by plain equivalents, module-level functions because
dy2static re-executes their source with this module's globals.

Why the cached step is written out instead of converting PaddleNLP's own cache path: `LlamaModel.forward` with
`past_key_values` builds masks and caches with Python control flow Paddle 2.6.2's dy2static does not convert in
full-graph mode, and PaddleNLP's inference models (`paddlenlp.experimental.transformers`) need GPU-only fused ops.
The decode program takes each layer's past keys and values as inputs of their own and returns only the new token's
(the caller appends them: serving/engine/runtime.py), so no cache is copied inside the program. Export's parity
gates check all three programs against the dynamic model (export/gates.py).
"""
from __future__ import annotations

import math
from pathlib import Path
import json

import core  # noqa: F401  (zlib before paddle)
import paddle  # noqa: E402

from core import hf_checkpoint  # noqa: E402
from core.config import Config  # noqa: E402
from core.workarounds.cpu_runtime import cpu_llama_ops_enabled  # noqa: E402
from core.errors import ConfigError
from core.files import user_cache
from core.tokenizer import model_vocab_size

_ORIGINAL: dict = {}


# ---------------------------------------------------------------------------------------------------- building
def llama_config(config: Config, tokenizer, tensor_parallel_degree: int = 1, tensor_parallel_rank: int = 0):
    from paddlenlp.transformers import LlamaConfig


    m = config.model
    vocab_size = m.vocab_size or model_vocab_size(tokenizer)
    if len(tokenizer) > vocab_size:
        raise ConfigError(f"the tokenizer has {len(tokenizer)} tokens and the model's embedding {vocab_size} rows "
                          f"(model.vocab_size{', from ' + m.init_from if m.init_from else ''}): use the model's own "
                          "tokenizer")
    model_config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_key_value_heads,
        max_position_embeddings=m.max_position_embeddings,
        seq_length=config.training.seq_length,
        rms_norm_eps=m.rms_norm_eps,
        rope_theta=m.rope_theta,
        **hf_checkpoint.paddle_rope(hf_checkpoint.rope_scaling(m.rope_scaling)),
        attention_bias=m.attention_bias,
        bos_token_id=tokenizer.cls_token_id,
        eos_token_id=tokenizer.sep_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        use_recompute=config.parallel.recompute,
        tensor_parallel_degree=tensor_parallel_degree,
        tensor_parallel_rank=tensor_parallel_rank,
        # ParallelCrossEntropy (c_softmax_with_cross_entropy) has no CPU kernel: gather the logits on CPU instead.
        tensor_parallel_output=config.parallel.device == "gpu",
    )
    # Set after construction, as PaddleNLP's own llm/run_pretrain.py does: in 2.8.1 LlamaConfig(use_flash_attention=
    # True) ends up False (PretrainedConfig.__init__ resets it from kwargs it no longer has).
    for key, value in performance_model_settings(config.performance).items():
        setattr(model_config, key, value)
    return model_config


def performance_model_settings(perf) -> dict:
    """The config's performance section -> LlamaConfig keyword arguments, exactly (validated in core/config.py: the
    GPU kernels are refused on CPU). Export always converts to the plain, unfused model (export/convert.py)."""
    return {"use_flash_attention": perf.flash_attention, "use_fused_rms_norm": perf.fused_rms_norm,
            "use_fused_rope": perf.fused_rope, "fuse_attention_qkv": perf.fuse_attention_qkv,
            "fuse_attention_ffn": perf.fuse_attention_ffn, "sequence_parallel": perf.sequence_parallel,
            "recompute_granularity": perf.recompute_granularity, "pp_recompute_interval": perf.pp_recompute_interval}


def pipeline_model_class():
    """PaddleNLP's `LlamaForCausalLMPipe`, split where `parallel.stage_layers` says.

    LlamaForCausalLMPipe hard-codes `seg_method="layer:LlamaDecoderLayer"` (equal decoder layers per stage) in its
    __init__; Paddle's PipelineLayer also accepts a list of stage boundaries, so `_segment_network` is handed the
    boundaries from the layout when the split is uneven (interleaved schedules need the even split: Paddle asserts)."""
    from paddlenlp.transformers import LlamaForCausalLMPipe

    class BalancedLlamaPipe(LlamaForCausalLMPipe):
        def _segment_network(self, seg_method):
            return super()._segment_network(getattr(self.config, "stage_boundaries", None) or seg_method)

    return BalancedLlamaPipe


def build_model(config: Config, tokenizer, tensor_parallel_degree: int, tensor_parallel_rank: int,
                pipeline: bool):
    """Random init (seeded by the caller), or the weights in `model.init_from`, split for this rank."""
    from paddlenlp.transformers import LlamaForCausalLM


    if config.parallel.device == "cpu" and config.parallel.mode == "manual":
        apply_cpu_ops()
    apply_architecture()
    cls = pipeline_model_class() if pipeline else LlamaForCausalLM
    model_config = llama_config(config, tokenizer, tensor_parallel_degree, tensor_parallel_rank)
    if pipeline:
        layout = config.layout()
        model_config.virtual_pp_degree = layout.virtual_stages
        model_config.stage_boundaries = None if layout.uniform_split else layout.stage_boundaries()
    if config.model.init_from:
        return cls.from_pretrained(str(weights_dir(config.model.init_from)), config=model_config)
    return cls(model_config)


def weights_dir(init_from: str):
    """The directory PaddleNLP loads for model.init_from: it as it is, or a Hugging Face checkpoint's conversion
    (core/hf_checkpoint.py; made once per content key in the user cache, `models/`)."""
    if hf_checkpoint.is_hf_checkpoint(init_from):
        return hf_checkpoint.converted(init_from, user_cache("models"), _save_pdparams)
    return Path(init_from)


def _save_pdparams(state: dict, directory) -> None:
    """A converted checkpoint's weights as model_state.pdparams, not safetensors: PaddleNLP 2.8.1's from_pretrained
    under tensor parallel loads other weights from a numpy-format model.safetensors than from the same tensors as
    .pdparams (core/workarounds/__init__.py OVERRIDES)."""
    paddle.save({name: paddle.to_tensor(value) for name, value in state.items()}, str(directory / "model_state.pdparams"))


def rotary_tables(cfg):
    """(cos, signed sin) [max positions, head_dim] of the model's rotary embedding (PaddleNLP's LlamaRotaryEmbedding,
    base cfg.rope_theta, halves concatenated, frequencies from rope_inv_freq); linear rope scaling (PaddleNLP's
    LinearScalingRotaryEmbedding) divides the positions by the factor. Dynamic NTK is the plain rotary at these
    positions (it changes nothing inside max_position_embeddings)."""
    positions = paddle.arange(cfg.max_position_embeddings, dtype="float32")
    if getattr(cfg, "rope_scaling_type", None) == "linear":
        positions = positions / float(cfg.rope_scaling_factor)
    emb = paddle.concat([paddle.einsum("i,j->ij", positions, rope_inv_freq(cfg))] * 2, axis=-1)
    return emb.cos(), signed_sin(emb.sin())


def rope_inv_freq(cfg):
    """The rotary frequencies [head_dim / 2], float32 as PaddleNLP computes them: 1 / theta^(2i / head_dim); with
    llama3 rope scaling (Llama 3.1, HF's _compute_llama3_parameters) wavelengths longer than original context /
    low_freq_factor divided by the factor, shorter than original context / high_freq_factor kept, those between
    blended smoothly."""
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    inv_freq = 1.0 / (float(getattr(cfg, "rope_theta", 10000.0))
                      ** (paddle.arange(0, head_dim, 2).astype("float32") / head_dim))
    if getattr(cfg, "rope_scaling_type", None) != "llama3":
        return inv_freq
    r = cfg.rope_scaling
    factor, low, high, context = (r["factor"], r["low_freq_factor"], r["high_freq_factor"],
                                  r["original_max_position_embeddings"])
    wavelength = 2 * math.pi / inv_freq
    scaled = paddle.where(wavelength > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelength - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = paddle.logical_and(wavelength >= context / high, wavelength <= context / low)
    return paddle.where(medium, blended, scaled)


# The plain model every export and evaluation loads: no GPU kernels, unfused q/k/v and gate/up weights (PaddleNLP
# splits fused checkpoint weights on load), the layout CachedLlamaStep read.
KERNELS_OFF = {"use_flash_attention": False, "use_fused_rms_norm": False, "use_fused_rope": False,
               "sequence_parallel": False}
PORTABLE = {**KERNELS_OFF, "fuse_attention_qkv": False, "fuse_attention_ffn": False}


def load_merged(checkpoint_dir, dtype: str = "float32", portable: bool = True):
    """A single-device model from a unified (merged, full-tensor) checkpoint, whatever layout wrote it, or from a
    Hugging Face checkpoint (a LoRA run's base): the portable model, or (portable=False) with the weight layout the
    checkpoint was trained with."""
    from paddlenlp.transformers import LlamaForCausalLM

    apply_cpu_ops()  # (export and evaluation run on CPU)
    apply_architecture()
    overrides = PORTABLE if portable else KERNELS_OFF
    return LlamaForCausalLM.from_pretrained(str(weights_dir(checkpoint_dir)), tensor_parallel_degree=1,
                                            tensor_parallel_rank=0,
                                            tensor_parallel_output=False, dtype=dtype, **overrides)


def is_fused(checkpoint_dir) -> bool:
    """Was the checkpoint trained with fused q/k/v or gate/up weights (its config.json says)?"""
    saved = json.loads((Path(checkpoint_dir) / "config.json").read_text())
    return bool(saved.get("fuse_attention_qkv") or saved.get("fuse_attention_ffn"))


# ---------------------------------------------------------------------------------- q/k/v biases, llama3 rope
BIASED = ("q_proj", "k_proj", "v_proj")
_BIAS_INSTALLED: list = []


def apply_architecture() -> None:
    """What the supported architectures need that PaddleNLP 2.8.1's Llama does not have. llama3 rope scaling
    (rope_scaling_type "llama3", unknown to its _init_rope): the plain rotary embedding with rope_inv_freq's
    frequencies. And q/k/v biases, Qwen2's one difference from Llama in the attention:
    with `attention_bias` in the model's config, LlamaAttention's q/k/v layers get a bias (a zero-initialised
    parameter of the layer, as its own bias would be: Linear and ColumnParallelLinear add `self.bias` in forward; split
    over tensor-parallel ranks as the weight's columns), and the tensor-parallel mappings split and merge the biases
    with their weights (loading a checkpoint on a tp rank, saving a unified one). Pipeline stages build the same
    LlamaAttention. Idempotent."""
    import paddlenlp.transformers.llama.modeling as llama
    import paddlenlp.transformers.llama.modeling_pp as llama_pp

    if _BIAS_INSTALLED:
        return
    _BIAS_INSTALLED.append(True)
    original_init = llama.LlamaAttention.__init__
    original_rope = llama.LlamaAttention._init_rope
    original_mappings = llama.LlamaPretrainedModel._get_tensor_parallel_mappings.__func__

    def init(self, config, *args, **kwargs):
        original_init(self, config, *args, **kwargs)
        if getattr(config, "attention_bias", False):
            for name in BIASED:
                _add_bias(getattr(self, name))

    def mappings(cls, config, is_split=True):
        actions = original_mappings(cls, config, is_split)
        if getattr(config, "attention_bias", False):
            actions.update({k[:-len("weight")] + "bias": v for k, v in actions.items()
                            if k.endswith(tuple(f"self_attn.{n}.weight" for n in BIASED))})
        return actions

    def init_rope(self):
        if getattr(self.config, "rope_scaling_type", None) != "llama3":
            return original_rope(self)
        self.rotary_emb = llama.LlamaRotaryEmbedding(self.head_dim, max_position_embeddings=self.max_position_embeddings,
                                                     base=self.config.rope_theta)
        self.rotary_emb.inv_freq = rope_inv_freq(self.config)
        self.rotary_emb._set_cos_sin_cache(seq_len=self.max_position_embeddings)

    llama.LlamaAttention.__init__ = init
    llama.LlamaAttention._init_rope = init_rope
    llama.LlamaPretrainedModel._get_tensor_parallel_mappings = classmethod(mappings)
    llama_pp.LlamaForCausalLMPipe._get_tensor_parallel_mappings = classmethod(mappings)


def _add_bias(layer) -> None:
    out = layer.weight.shape[1]  # ([in, out]: this rank's columns)
    layer.bias = layer.create_parameter(shape=[out], dtype=layer.weight.dtype, is_bias=True,
                                        default_initializer=paddle.nn.initializer.Constant(0.0))
    if getattr(layer.weight, "is_distributed", False):
        layer.bias.is_distributed, layer.bias.split_axis = True, 0


# ---------------------------------------------------------------------------------------------------- CPU ops
def apply_cpu_ops() -> bool:
    """Install the CPU replacements in PaddleNLP's Llama (idempotent). Returns whether they are in place."""
    if not cpu_llama_ops_enabled():
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


def restore_cpu_ops() -> None:
    """PaddleNLP's own code again (tests compare the two)."""
    if not _ORIGINAL:
        return
    import paddlenlp.transformers.llama.modeling as llama

    llama.LlamaRMSNorm.forward = _ORIGINAL["rms_forward"]
    llama.apply_rotary_pos_emb = _ORIGINAL["apply_rotary_pos_emb"]
    llama.LlamaPretrainingCriterion.forward = _ORIGINAL["criterion_forward"]
    _ORIGINAL.clear()


def _float32(x):
    return x if x.dtype == paddle.float32 else x.astype("float32")


def normalise(x, eps: float):
    """RMSNorm before its weight, with `square` (1). Also the norm of compiled training and of the cached step."""
    x = x.astype("float32")  # (a copy, as PaddleNLP's: the gradient then sums in the same order, bit for bit)
    return paddle.rsqrt(paddle.square(x).mean(-1, keepdim=True) + eps) * x


def signed_sin(sin):
    """sin with the sign of rotate_half's first half folded in (2): rotate_half(x) * sin == roll(x, D/2) * this."""
    half = sin.shape[-1] // 2
    return paddle.concat([-sin[..., :half], sin[..., half:]], axis=-1)


def rotate(x, cos, signed_sin):
    """x * cos + rotate_half(x) * sin (2, 3); the tables broadcast to x's shape (a head axis of 1, say)."""
    return x * cos.expand_as(x) + paddle.roll(x, x.shape[-1] // 2, axis=-1) * signed_sin.expand_as(x)


def _rms_norm_forward(self, hidden_states):
    """LlamaRMSNorm.forward without the fused kernel, as PaddleNLP computes it (1, 4)."""
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
    if position_ids is None:
        cos, sin = cos[:, : q.shape[1], :, :], sin[:, : q.shape[1], :, :]  # [1, T, 1, D]
    else:
        cos, sin = cos.squeeze(axis=[0, 2]), sin.squeeze(axis=[0, 2])  # [T, D]
        cos, sin = cos[position_ids].unsqueeze(2), sin[position_ids].unsqueeze(2)  # [B, T, 1, D]
    sin = signed_sin(sin)
    return rotate(q, cos, sin), rotate(k, cos, sin)


def _criterion_forward(self, prediction_scores, masked_lm_labels):
    """LlamaPretrainingCriterion.forward for the plain cross entropy, without copying float32 logits (4)."""
    if self.enable_parallel_cross_entropy or self.config.sep_parallel_degree > 1:
        return _ORIGINAL["criterion_forward"](self, prediction_scores, masked_lm_labels)
    with paddle.amp.auto_cast(False):
        masked_lm_loss = self.loss_func(_float32(prediction_scores), masked_lm_labels.unsqueeze(2))
        masked_lm_loss = masked_lm_loss[masked_lm_loss > 0]  # skip ignore_index, whose loss is 0
        loss = paddle.mean(masked_lm_loss)
    return loss


# ---------------------------------------------------------------------------------------------------- compiled
_SQUARE = cpu_llama_ops_enabled()  # (a plain bool: dy2static evaluates the branch below in Python)


def _static_rms_norm_forward(self, hidden_states):
    # Plain LlamaRMSNorm (no fused kernel, float32 weights) without the early returns dy2static mis-handles.
    if _SQUARE:
        normalised = normalise(hidden_states, self.variance_epsilon)
    else:
        hidden_states = hidden_states.astype("float32")
        normalised = paddle.rsqrt(hidden_states.pow(2).mean(-1, keepdim=True) + self.variance_epsilon) * hidden_states
    return normalised * self.weight


def _static_mlp_forward(self, x):
    # Plain LlamaMLP (fuse_attention_ffn=False): down(silu(gate(x)) * up(x)).
    return self.down_proj(paddle.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def compile_forward(model) -> None:
    """Training: run the model's forward as one static program (whole-graph dy2static), the two forwards replaced
    for the rest of the process. Parameters, state_dict and checkpoints are those of the eager model."""
    from paddlenlp.transformers.llama import modeling

    modeling.LlamaRMSNorm.forward, modeling.LlamaMLP.forward = _static_rms_norm_forward, _static_mlp_forward
    model.forward = paddle.jit.to_static(model.forward, full_graph=True)


# ---------------------------------------------------------------------------------------------------- cached step
MASKED = -1e9


def _rms_norm(x, weight, eps: float):
    return normalise(x, eps) * weight


class CachedLlamaStep(paddle.nn.Layer):
    """One generation step over the model's own sublayers: prefill (input_ids, position_ids, key_mask) -> last
    logits, keys, values; decode (+ past keys/values per layer) -> logits, the new token's keys and values;
    extend (with_past and extend: T new tokens over a cached past, key_mask [B, P+T]) -> last logits, the T new
    tokens' keys and values, as prefill returns them; all_positions: logits of every position (FullSequence). Left
    padding: `key_mask` is 0 on pads and `position_ids` count real tokens only, so each row computes what it would
    alone (extend's past and new columns are each left-padded: masked columns may sit between them)."""

    def __init__(self, model, with_past: bool, all_positions: bool = False, extend: bool = False):
        super().__init__()
        self.model = model
        cfg = model.config
        self.with_past, self.all_positions, self.extend = with_past, all_positions, extend
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        cos, sin = rotary_tables(cfg)  # (the rotary table of LlamaRotaryEmbedding)
        self.register_buffer("cos_table", cos)
        self.register_buffer("signed_sin_table", sin)

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
            if self.with_past and self.extend:  # (T new tokens: the past and new keys in one attention)
                context = self._attend(q, paddle.concat([past_keys[index], k], axis=2),
                                       paddle.concat([past_values[index], v], axis=2), bias)
            elif self.with_past:
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
