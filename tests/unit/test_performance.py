"""config.performance: every setting reaches PaddleNLP exactly (the LlamaConfig and TrainingArguments the worker
would build, checked without a GPU), and invalid combinations are refused before launch, naming the keys."""
import dataclasses
from pathlib import Path

import pytest

from core import REPO_ROOT
from core.config import ConfigError, load_config

GPU_100B = REPO_ROOT / "configs" / "llama-100b-512gpu.yaml"
# Every setting of the section on, in two configs (PaddleNLP allows data- or sharding-overlap, not both).
EVERYTHING_DP = ["performance.flash_attention=true", "performance.fused_rms_norm=true", "performance.fused_rope=true",
                 "performance.fuse_attention_qkv=true", "performance.fuse_attention_ffn=true",
                 "performance.sequence_parallel=true", "performance.recompute_granularity=core_attn",
                 "performance.pp_recompute_interval=2", "performance.amp_master_grad=true",
                 "performance.mp_async_allreduce=true", "performance.dp_comm_overlap=true",
                 "performance.distributed_dataloader=true"]
EVERYTHING_SHARDING = ["parallel.data=1", "parallel.sharding_stage=1", "parallel.sharding_degree=4",
                       "performance.sharding_comm_overlap=true", "performance.split_param=true",
                       "performance.amp_master_grad=true"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from core.tokenizer import SPECIAL_TOKENS, load_tokenizer, write_tokenizer

    directory = tmp_path_factory.mktemp("tok")
    write_tokenizer(SPECIAL_TOKENS + list("人工智能这本书"), directory)
    return load_tokenizer(directory)


def translate(config, tokenizer):
    from paddlenlp.trainer import TrainingArguments

    from model.llama import llama_config
    from training.rank import training_argument_values

    layout = config.layout()
    values = training_argument_values(config, layout, Path("unused"))
    unknown = set(values) - {f.name for f in dataclasses.fields(TrainingArguments)}
    assert not unknown, unknown  # every key is an argument PaddleNLP 2.8.1 knows
    return llama_config(config, tokenizer, layout.tp, 0), values


def test_every_setting_reaches_paddlenlp(tokenizer):
    config = load_config(GPU_100B, EVERYTHING_DP)
    model, args = translate(config, tokenizer)
    assert (model.use_flash_attention, model.use_fused_rms_norm, model.use_fused_rope) == (True, True, True)
    assert (model.fuse_attention_qkv, model.fuse_attention_ffn, model.sequence_parallel) == (True, True, True)
    assert (model.recompute_granularity, model.pp_recompute_interval, model.use_recompute) == ("core_attn", 2, True)
    assert args["amp_master_grad"] is True and args["distributed_dataloader"] is True
    assert args["tensor_parallel_config"] == "enable_mp_async_allreduce"
    assert args["pipeline_parallel_config"] == "enable_dp_comm_overlap"  # (GPU: partial send/recv stays on)
    assert args["sharding_parallel_config"] == "" and args["recompute"] is True
    assert (args["bf16"], args["fp16_opt_level"], args["tensor_parallel_degree"]) == (True, "O2", 8)

    sharded = load_config(GPU_100B, EVERYTHING_SHARDING)
    _, args = translate(sharded, tokenizer)
    assert args["pipeline_parallel_config"] == "enable_sharding_comm_overlap"
    assert args["sharding_parallel_config"] == "split_param" and args["sharding"] == "stage1"


@pytest.mark.parametrize("name", ["llama-100b-512gpu.yaml", "llama-100b-512gpu-interleaved.yaml"])
def test_the_gpu_example_configs_turn_on_the_reference_settings(tokenizer, name):
    config = load_config(REPO_ROOT / "configs" / name)
    model, args = translate(config, tokenizer)
    assert (model.use_flash_attention, model.use_fused_rms_norm, model.use_fused_rope, model.sequence_parallel) == \
        (True, True, True, True)
    assert args["amp_master_grad"] is True and args["distributed_dataloader"] is True
    assert args["unified_checkpoint"] is True and args["bf16"] is True


def test_cpu_defaults_pass_nothing_gpu_only(tokenizer):
    config = load_config(REPO_ROOT / "configs" / "tiny-tp2pp2.yaml")
    model, args = translate(config, tokenizer)
    assert not (model.use_flash_attention or model.use_fused_rms_norm or model.use_fused_rope or
                model.sequence_parallel or model.fuse_attention_qkv or model.fuse_attention_ffn)
    assert args["pipeline_parallel_config"] == "disable_partial_send_recv"  # gloo: no partial send/recv
    assert args["tensor_parallel_config"] == args["sharding_parallel_config"] == ""


@pytest.mark.parametrize("overrides, message", [
    (["performance.flash_attention=true"], "performance.flash_attention: GPU only (flash attention is a CUDA kernel)"),
    (["performance.fused_rms_norm=true"], "performance.fused_rms_norm: GPU only"),
    (["performance.fused_rope=true"], "performance.fused_rope: GPU only"),
    (["parallel.tensor=2", "performance.sequence_parallel=true"], "needs reduce_scatter, which gloo lacks"),
    (["parallel.device=gpu", "performance.sequence_parallel=true"], "performance.sequence_parallel: needs "
                                                                     "parallel.tensor > 1"),
    (["performance.recompute_granularity=core_attn"], "only with parallel.recompute=true"),
    (["performance.recompute_granularity=partial"], "performance.recompute_granularity: 'partial' is not allowed"),
    (["parallel.recompute=true", "performance.pp_recompute_interval=2"], "parallel.pipeline > 1"),
    (["parallel.device=gpu", "performance.amp_master_grad=true"], "needs parallel.amp_dtype set and "
                                                                  "parallel.amp_level=O2"),
    (["parallel.device=gpu", "parallel.tensor=2", "performance.mp_async_allreduce=true", "parallel.data=1"],
     None),
    (["parallel.device=gpu", "performance.mp_async_allreduce=true"], "performance.mp_async_allreduce: needs "
                                                                     "parallel.tensor > 1"),
    (["parallel.device=gpu", "performance.dp_comm_overlap=true"], "parallel.pipeline > 1 and parallel.data > 1"),
    (["parallel.device=gpu", "performance.split_param=true"], "only with parallel.sharding_stage=1"),
    (["parallel.device=gpu", "performance.distributed_dataloader=true"], "parallel.tensor > 1 or parallel.pipeline"),
    (["parallel.mode=semi_auto", "parallel.tensor=2", "performance.fuse_attention_qkv=true"],
     "not with parallel.mode=semi_auto"),
])
def test_invalid_combinations_are_refused_naming_the_keys(overrides, message):
    if message is None:
        load_config(None, overrides)  # valid: a control that the refusals are about the combination
        return
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")
                       .replace("'", "'").replace(">", ">")):
        load_config(None, overrides)


def test_the_100b_sharding_overlap_needs_master_grads():
    with pytest.raises(ConfigError, match="performance.sharding_comm_overlap: PaddleNLP requires "
                                          "performance.amp_master_grad"):
        load_config(GPU_100B, [o for o in EVERYTHING_SHARDING if "amp_master_grad" not in o] +
                    ["performance.amp_master_grad=false"])
    with pytest.raises(ConfigError, match="allows one, not both"):
        load_config(GPU_100B, EVERYTHING_SHARDING + ["parallel.data=2", "parallel.sharding_degree=2",
                                                     "performance.dp_comm_overlap=true"])
