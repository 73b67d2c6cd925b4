"""PaddleNLP Llama built from the typed config: single-device, tensor-parallel, or pipeline (`LlamaForCausalLMPipe`)."""
from __future__ import annotations

from core.config import Config
from core.workarounds import cpu_llama_ops


def llama_config(config: Config, tokenizer, tensor_parallel_degree: int = 1, tensor_parallel_rank: int = 0):
    from paddlenlp.transformers import LlamaConfig

    from core.tokenizer import model_vocab_size

    m = config.model
    model_config = LlamaConfig(
        vocab_size=model_vocab_size(tokenizer),
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_key_value_heads,
        max_position_embeddings=m.max_position_embeddings,
        seq_length=config.training.seq_length,
        rms_norm_eps=m.rms_norm_eps,
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
    for key, value in performance_model_settings(config).items():
        setattr(model_config, key, value)
    return model_config


def performance_model_settings(config: Config) -> dict:
    """config.performance -> LlamaConfig keyword arguments, exactly (validated in core/config.py: the GPU kernels
    are refused on CPU). Export always converts to the plain, unfused model (training/convert.py)."""
    perf = config.performance
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

    from core.layout import ParallelLayout

    if config.parallel.device == "cpu" and config.parallel.mode == "manual":
        cpu_llama_ops.apply()
    cls = pipeline_model_class() if pipeline else LlamaForCausalLM
    model_config = llama_config(config, tokenizer, tensor_parallel_degree, tensor_parallel_rank)
    if pipeline:
        layout = ParallelLayout.from_config(config)
        model_config.virtual_pp_degree = layout.virtual_stages
        model_config.stage_boundaries = None if layout.uniform_split else layout.stage_boundaries()
    if config.model.init_from:
        return cls.from_pretrained(config.model.init_from, config=model_config)
    return cls(model_config)


# The plain model every export and evaluation loads: no GPU kernels, unfused q/k/v and gate/up weights (PaddleNLP
# splits fused checkpoint weights on load), the layout training/kv_cache.py's programs read.
KERNELS_OFF = {"use_flash_attention": False, "use_fused_rms_norm": False, "use_fused_rope": False,
               "sequence_parallel": False}
PORTABLE = {**KERNELS_OFF, "fuse_attention_qkv": False, "fuse_attention_ffn": False}


def load_merged(checkpoint_dir, dtype: str = "float32", portable: bool = True):
    """A single-device model from a unified (merged, full-tensor) checkpoint, whatever layout wrote it: the
    portable model, or (portable=False) with the weight layout the checkpoint was trained with."""
    from paddlenlp.transformers import LlamaForCausalLM

    cpu_llama_ops.apply()  # (export and evaluation run on CPU)
    overrides = PORTABLE if portable else KERNELS_OFF
    return LlamaForCausalLM.from_pretrained(str(checkpoint_dir), tensor_parallel_degree=1, tensor_parallel_rank=0,
                                            tensor_parallel_output=False, dtype=dtype, **overrides)


def is_fused(checkpoint_dir) -> bool:
    """Was the checkpoint trained with fused q/k/v or gate/up weights (its config.json says)?"""
    import json
    from pathlib import Path

    saved = json.loads((Path(checkpoint_dir) / "config.json").read_text())
    return bool(saved.get("fuse_attention_qkv") or saved.get("fuse_attention_ffn"))
