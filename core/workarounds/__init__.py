"""Patches of Paddle / PaddleNLP / Paddle Serving code, one module per bug (this folder), and OVERRIDES below: the
one table of every place in the project that replaces or overrides their code, with the bug and the versions it is
for. When a pin in requirements/lock.txt changes, review the table. tests/unit/test_overrides.py finds every
override in the source (assignments into their modules, classes or objects; their private methods overridden in a
subclass) and fails on one that is not in the table, or on a row that no longer matches the code.

zlib: libpaddle.so (Paddle 2.6.2) exports its own zlib symbols; if it is loaded first, later zlib users (grpc,
safetensors, zip files) fail with "inconsistent stream state" or segfault. `core/__init__.py` imports zlib before
anything else, and everything imports `core` first.
"""
import zlib  # noqa: F401  (see the docstring: must precede every `import paddle`)
import warnings
from typing import NamedTuple


class Override(NamedTuple):
    module: str  # the file, from the repository root
    targets: tuple[str, ...]  # what it replaces: `Class.method`, `function`, or `attribute` of their objects
    bug: str  # why
    versions: str  # what it was verified against


OVERRIDES = (
    Override("core/workarounds/__init__.py", (), "libpaddle's own zlib symbols break later zlib users unless zlib "
             "loads first; warnings known to be harmless", "Paddle 2.6.2"),
    Override("core/workarounds/cpu_runtime.py", (), "MKL's generic kernels on AMD CPUs, Paddle's 1-thread default, "
             "Intel OpenMP's spin-wait (environment and set_num_threads only)", "Paddle 2.6.2 (MKL 2019.0.5, iomp5)"),
    Override("core/workarounds/cpu_gloo.py",
             ("broadcast_input_data", "ProcessGroupGloo.send_on_calc_stream", "ProcessGroupGloo.recv_on_calc_stream",
              "_legacy_C_ops", "_c_concat", "ParallelEnv._device_id", "batch_send_recv_on_calc_stream", "_sync_send",
              "_new_process_group_impl", "PipelineParallelWithInterleave._check_sanity"),
             "hybrid parallel (tensor / pipeline / sharding) assumes GPU collectives; on CPU over gloo they are "
             "missing, non-blocking or asserted away", "paddlepaddle 2.6.2 fleet"),
    Override("core/workarounds/paddlenlp_resume.py", ("load_single_card_checkpoint", "load_single_card_optimizer"),
             "resuming a checkpoint written by several ranks on one rank reads only the first shard", "PaddleNLP 2.8.1"),
    Override("core/workarounds/paddle_serving.py", ("ThreadChannel.push", "_grpc_gateway"),
             "the client package has no Python 3.11 build (stand-in in serving_compat/); logs land in the working "
             "directory; every channel push wakes every waiting thread; DEBUG records built per request; its Go "
             "HTTP gateway listens on every interface (a copy of libproxy_server.so listens on 127.0.0.1)",
             "Paddle Serving 0.9.0"),
    Override("core/workarounds/heap.py", (), "glibc keeps freed memory in its heap: each export gate started on the "
             "garbage of the one before (malloc_trim between stages); and maps every large block afresh: a serving "
             "worker's per-step arrays were page-faulted in again each step (mallopt: no mmap, no trim)",
             "glibc 2.36, Paddle 2.6.2"),
    Override("core/workarounds/cuda_libraries.py", (), "the GPU wheel dlopens unversioned CUDA library names that "
             "NVIDIA's pip packages do not provide (links + LD_LIBRARY_PATH)", "paddlepaddle-gpu 2.6.2, CUDA 11.8"),
    Override("model/llama.py", ("LlamaRMSNorm.forward", "apply_rotary_pos_emb", "LlamaPretrainingCriterion.forward"),
             "slow CPU kernels under PaddleNLP's Llama (pow, rotate_half, middle-axis broadcast, float32 cast)",
             "PaddleNLP 2.8.1 / Paddle 2.6.2"),
    Override("model/llama.py", ("LlamaMLP.forward",), "dy2static mis-transforms the early returns of LlamaRMSNorm / "
             "LlamaMLP.forward (NameError: __return_N) in whole-graph compiled training", "Paddle 2.6.2 / PaddleNLP 2.8.1"),
    Override("model/llama.py", ("LlamaForCausalLMPipe._segment_network",), "LlamaForCausalLMPipe hard-codes an even "
             "split of decoder layers over pipeline stages", "PaddleNLP 2.8.1"),
    Override("model/llama.py", ("LlamaAttention.__init__", "LlamaPretrainedModel._get_tensor_parallel_mappings",
                                "LlamaForCausalLMPipe._get_tensor_parallel_mappings"),
             "PaddleNLP's Llama has no q/k/v biases (Qwen2's attention): they are added with the config's "
             "attention_bias, and split / merged over tensor-parallel ranks with their weights", "PaddleNLP 2.8.1"),
    Override("model/llama.py", ("LlamaAttention._init_rope",), "PaddleNLP's Llama knows rope_scaling_type linear / "
             "ntk / dynamic_ntk, not Llama 3.1's llama3 (its _init_rope raises on it): the plain rotary embedding "
             "with llama3's rescaled frequencies", "PaddleNLP 2.8.1"),
    Override("model/llama.py", (), "from_pretrained under tensor parallel from a numpy-format "
             "model.safetensors gives other weights than the same tensors as model_state.pdparams (an imported Llama, "
             "tp2: step-1 loss 6.9935 vs 7.0705 single-process; from .pdparams 7.0705): a converted Hugging Face "
             "checkpoint is written as .pdparams", "PaddleNLP 2.8.1"),
    Override("training/rank.py", ("Trainer._get_train_sampler",), "Trainer shuffles differently in one process and "
             "in several, so layouts would see different batches", "PaddleNLP 2.8.1"),
    Override("training/rank.py", ("Trainer._maybe_log_save_evaluate",), "a resume restarts the loss window at the "
             "checkpoint's step, so the first loss logged after it averages fewer steps than an uninterrupted run "
             "(the window is saved in the checkpoint and continued)", "PaddleNLP 2.8.1"),
    Override("training/rank.py", ("Trainer._save_checkpoint", "Trainer._wrap_model"), "no hook when a save starts "
             "(checkpoint stall) or on the pipeline engine the Trainer wraps the model in (stage timing)",
             "PaddleNLP 2.8.1"),
    Override("training/semi_auto.py", ("Trainer._wrap_model", "Trainer._get_train_sampler",
                                       "Trainer._get_eval_sampler", "Trainer._save_checkpoint", "Trainer._save",
                                       "Trainer._nested_gather"),
             "PaddleNLP's AutoTrainer calls ProcessMesh.get_rank_by_dim_and_process_id, which Paddle 2.6.2 lacks, "
             "so the plain Trainer drives semi-automatic models: no fleet wrapping, the same batch on every rank, "
             "full-tensor saves, gathered eval outputs (a mixin joined to Trainer with type())",
             "PaddleNLP 2.8.1, paddlepaddle 2.6.2"),
    Override("training/metrics/stage_timing.py", ("_forward_step", "_backward_step"), "the fleet pipeline engine has no "
             "per-micro-batch timing; its methods are wrapped on the one instance", "paddlepaddle 2.6.2 fleet"),
    Override("training/checkpoint/async_write.py", ("file_save_async_or_sync",), "PaddleNLP's async_save spawns a "
             "process per file that nothing waits for or fsyncs, and is ignored on one process", "PaddleNLP 2.8.1"),
    Override("pipeline/runner/visualdl_server.py", (), "VisualDL's page (/app/index) is a 500 for a request without "
             "Accept-Language: its locale selector returns None and Werkzeug 3 refuses a None cookie; the server is "
             "started with --language en", "visualdl 2.5.3, Werkzeug 3.1"),
)

# Warnings known to be harmless here, silenced where every process starts (anything else still shows):
HARMLESS_WARNINGS = (
    "Setuptools is replacing distutils",  # setuptools' shim, triggered by paddle's `import distutils`
    r"The Attr\(force_cpu\) of Op\(fill_constant\)",  # Paddle 2.6.2's own ops in dy2static export programs
    "paddle.assign doesn't support float64",  # export: rotary tables are float32 anyway
    "the input shapes of select_input should have the same rank",  # dy2static control flow in PaddleNLP's Llama
)


def apply_process_wide() -> None:
    """What every process of the pipeline needs before paddle loads: the CPU math runtime's environment and the
    warning filters."""
    from core.workarounds import cpu_runtime, cuda_libraries

    cuda_libraries.apply()  # (GPU environments only: may re-execute this process, so first)
    cpu_runtime.prepare_process()
    for message in HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=message)
