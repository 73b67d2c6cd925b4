"""Workaround for PaddleNLP 2.8.1: a unified checkpoint written by several ranks resumes on one process.

The bug: `paddlenlp/trainer/plugins/unified_checkpoint.py` loads a single-process resume with
`load_single_card_checkpoint` and `load_single_card_optimizer`, which read only `resolved_archive_file[0]`, the first
of the `model-0000k-of-0000N` / `optimizer-0000k-of-0000N` shard files. A checkpoint saved by a tensor- or
pipeline-parallel run has one shard per rank, so on one process the model silently keeps the random init of every
weight that is not in shard 1, and the first optimizer step fails with
`AssertionError: Optimizer set error, embedding_0.w_0_moment2_0 should in state dict`.

The fix, applied by the worker on single-process runs only: the same two functions, reading every shard. Everything
else is PaddleNLP's own code path (multi-process resumes already read all shards through their index).
"""
from __future__ import annotations

import gc
import os

FIXED_VERSION = "2.8.1"  # (paddlenlp.__version__ reads "2.8.1.post")


def _load_shards(files: list[str], keys) -> dict:
    from paddlenlp.trainer.plugins import unified_checkpoint as uc

    state: dict = {}
    for path in files:
        state.update(uc.load_state_dict(path, None, keys))
    return state


def load_single_card_checkpoint(args, model, resume_from_checkpoint: str):
    from paddlenlp.trainer.plugins import unified_checkpoint as uc

    # (PaddleNLP's choice, kept: a LoRA or prefix model's checkpoint holds its adapters under the PEFT index)
    peft = isinstance(model, (uc.LoRAModel, uc.PrefixModelForCausalLM))
    index = os.path.join(resume_from_checkpoint, uc.SAFE_PEFT_WEIGHTS_INDEX_NAME if peft else uc.SAFE_WEIGHTS_INDEX_NAME)
    files, metadata = uc.get_checkpoint_shard_files(pretrained_model_name_or_path=resume_from_checkpoint,
                                                    index_filename=index)
    expected = set(uc.get_expected_state_dict(model).keys())
    missing = expected - set(metadata["all_checkpoint_keys"])
    if missing:
        raise ValueError(f"Missing keys: {missing}")
    state = _load_shards(files, expected)
    errors = uc._load_state_dict_into_model(model, state, "")
    del state
    gc.collect()
    if errors:
        raise RuntimeError(f"Error(s) in loading state dict for {model.__class__.__name__}:\n\t{errors}")


def load_single_card_optimizer(args, model, optimizer, resume_from_checkpoint: str):
    import paddle
    from paddlenlp.trainer.plugins import unified_checkpoint as uc

    returned = uc.nested_copy(optimizer.state_dict())
    files, metadata = uc.get_optimizer_shard_files(
        optimizer_path=resume_from_checkpoint,
        index_filename=os.path.join(resume_from_checkpoint, uc.SAFE_OPTIMIZER_INDEX_NAME))
    has_master_weights = bool(metadata["master_weights"])
    static_names = {k: v.name for k, v in uc.get_expected_state_dict(model).items()}
    for key, value in _load_shards(files, metadata["all_optimizer_keys"]).items():
        structure_name, moment = key.split("/")
        parts = [static_names[structure_name], uc.FP32_MASTER, moment] if has_master_weights else \
            [static_names[structure_name], moment]
        name = "_".join(parts)
        returned[name] = value
        returned[name].name = name
    if has_master_weights:
        returned["master_weights"] = {}
        files_mw, metadata_mw = uc.get_optimizer_shard_files(
            optimizer_path=resume_from_checkpoint,
            index_filename=os.path.join(resume_from_checkpoint, uc.SAFE_MASTER_WEIGHTS_INDEX_NAME))
        for key, value in _load_shards(files_mw, metadata_mw["all_optimizer_keys"]).items():
            static_name = static_names[key]
            returned["master_weights"][static_name] = value
            value.name = "_".join([static_name, uc.FP32_MASTER])
    return uc.nested_copy_place(returned, place=paddle.framework._current_expected_place(), blocking=True)


def apply() -> None:
    """Install the fixed loaders (only on the PaddleNLP version they were written against)."""
    import paddlenlp
    from paddlenlp.trainer.plugins import unified_checkpoint as uc

    if not paddlenlp.__version__.startswith(FIXED_VERSION):
        raise RuntimeError(f"core/workarounds/paddlenlp_resume.py fixes PaddleNLP {FIXED_VERSION}, found "
                           f"{paddlenlp.__version__}: check whether the single-card loaders still read one shard")
    uc.load_single_card_checkpoint = load_single_card_checkpoint
    uc.load_single_card_optimizer = load_single_card_optimizer
