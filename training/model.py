"""PaddleNLP Llama built from the typed config: single-device, tensor-parallel, or pipeline (`LlamaForCausalLMPipe`)."""
from __future__ import annotations

from pipeline.config import Config


def llama_config(config: Config, tokenizer, tensor_parallel_degree: int = 1, tensor_parallel_rank: int = 0):
    from paddlenlp.transformers import LlamaConfig

    from pipeline.tokenizer import model_vocab_size

    m = config.model
    return LlamaConfig(
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
        # Fused kernels are GPU-only and the plain paths are what export converts; keep the model portable.
        use_flash_attention=False,
        use_fused_rms_norm=False,
        use_fused_rope=False,
        fuse_attention_qkv=False,
        fuse_attention_ffn=False,
        tie_word_embeddings=False,
        use_recompute=config.parallel.recompute,
        tensor_parallel_degree=tensor_parallel_degree,
        tensor_parallel_rank=tensor_parallel_rank,
        # ParallelCrossEntropy (c_softmax_with_cross_entropy) has no CPU kernel: gather the logits on CPU instead.
        tensor_parallel_output=config.parallel.device == "gpu",
    )


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

    from pipeline.layout import ParallelLayout

    cls = pipeline_model_class() if pipeline else LlamaForCausalLM
    model_config = llama_config(config, tokenizer, tensor_parallel_degree, tensor_parallel_rank)
    if pipeline:
        layout = ParallelLayout.from_config(config)
        model_config.virtual_pp_degree = layout.virtual_stages
        model_config.stage_boundaries = None if layout.uniform_split else layout.stage_boundaries()
    if config.model.init_from:
        return cls.from_pretrained(config.model.init_from, config=model_config)
    return cls(model_config)


def load_merged(checkpoint_dir, dtype: str = "float32"):
    """A single-device model from a unified (merged, full-tensor) checkpoint, whatever layout wrote it."""
    from paddlenlp.transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(checkpoint_dir), tensor_parallel_degree=1, tensor_parallel_rank=0,
                                            tensor_parallel_output=False, dtype=dtype)
