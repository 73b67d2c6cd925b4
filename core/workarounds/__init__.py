"""Every workaround for a Paddle / PaddleNLP / Paddle Serving bug or limit, in one place. When a pinned version
changes (requirements/lock.txt), this is the folder to review; each module names the bug and the versions it fixes.

    (this file)       zlib before paddle; warnings known to be harmless           Paddle 2.6.2
    cpu_runtime       MKL's slow path on AMD CPUs, thread counts, OpenMP spin      Paddle 2.6.2 (MKL 2023 / iomp5)
    cpu_llama_ops     PaddleNLP's Llama on slow CPU kernels (pow, broadcasts, casts) PaddleNLP 2.8.1 / Paddle 2.6.2
    cpu_gloo          hybrid parallel (tensor/pipeline/sharding) on CPU over gloo  paddlepaddle 2.6.2 fleet
    paddlenlp_resume  resuming a multi-rank checkpoint on another layout           PaddleNLP 2.8.1
    dy2static_fix     dy2static of PaddleNLP's Llama (compiled training)           Paddle 2.6.2 / PaddleNLP 2.8.1
    paddle_serving    the client package the server imports; its log directory     Paddle Serving 0.9.0
    cuda_libraries    the CUDA 11.8 runtime from NVIDIA's pip packages (GPU wheel)  paddlepaddle-gpu 2.6.2

zlib: libpaddle.so (Paddle 2.6.2) exports its own zlib symbols; if it is loaded first, later zlib users (grpc,
safetensors, zip files) fail with "inconsistent stream state" or segfault. `core/__init__.py` imports zlib before
anything else, and everything imports `core` first.
"""
import zlib  # noqa: F401  (see the docstring: must precede every `import paddle`)
import warnings

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
