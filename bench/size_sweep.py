"""`make bench` section `sizes`: how cost grows with the work. The default model at hidden 128, 256, 512 and 1024
(the same depth, 32-wide heads, the MLP 2.6875 h wide, the default batch and sequence), each:
- training: the project's step (bench/training_speed.py, the default runtime settings, its own process) in tokens/s,
  and its share of the ceiling: every core at the fp32 matmul peak measured in that trial, at 6N' + 12Lhs a token;
- decode: export format 2's program (bench/decode_step.py) at batch 1 and 64 over 64 cached positions, one math
  thread, in tokens/s, and the share of one core's matmul peak measured here at 2N' + 4LhP a token;
- with PEERS=vllm, PyTorch eager's training step on the same architecture and batch (bench/peer_torch.py).
Small models spend their time in per-op costs (~6 us an op on CPU at batch 1) and the logits; as h grows the matmuls
take over, which is what a GPU run of a real size will see."""
from __future__ import annotations

import json
from pathlib import Path

from bench import decode_step, peer_torch
from bench.peer_vllm import side as peer_side
from bench.training_speed import SETTINGS, matmul_peak, prepared_run, trial
from core import arithmetic
from core.tokenizer import load_tokenizer, model_vocab_size
from export.hf import hf_config

SIZES = (128, 256, 512, 1024)
HEAD_DIM = 32


def shape(hidden: int) -> list[str]:
    heads = hidden // HEAD_DIM
    return [f"model.hidden_size={hidden}", f"model.intermediate_size={hidden * 344 // 128}",
            f"model.num_attention_heads={heads}", f"model.num_key_value_heads={heads}"]


def one_thread_peak() -> float:
    """fp32 matmul FLOP/s of one math thread (the decode programs' ceiling), measured now."""
    import core  # noqa: F401  (zlib before paddle)
    import paddle


    paddle.base.core.set_num_threads(1)  # (what Paddle gives a process anyway: core/workarounds/cpu_runtime.py, 2)
    return matmul_peak()


def run(out: Path, quick: bool, peer_python: Path | None = None) -> dict:
    sizes, steps = ((128, 256), 3) if quick else (SIZES, 6)
    peak_1 = one_thread_peak()
    rows = []
    for hidden in sizes:
        config, run_dir = prepared_run(out, shape(hidden), name=f"sizes-{hidden}")
        vocab = model_vocab_size(load_tokenizer(run_dir / "tokenizer"))
        train = trial(run_dir, list(SETTINGS)[-1], steps, out / "scratch")
        m = config.model
        model = decode_step.random_model(m.hidden_size, m.num_layers, m.num_attention_heads, m.intermediate_size,
                                         vocab, m.max_position_embeddings)
        decode = decode_step.decode_times(model, ("format 2",), (1, 64), 1 if quick else 3,
                                          2.0 if quick else 12.0)["format 2"]
        fpt = arithmetic.decode_flops_per_token(config.model, vocab, decode_step.PAST)
        row = {"hidden": hidden, "parameters": arithmetic.parameters(config.model, config.tokenizer, vocab),
               "train_tokens_per_s": train["tokens_per_s"], "train_mfu": train["mfu"],
               "matmul_peak_gflops": train["matmul_peak_gflops"], "decode_ops": decode["ops"],
               "one_thread_peak_gflops": peak_1 / 1e9,
               **{f"decode_b{b}_tokens_per_s": decode["batch"][b]["tokens_per_s"]["median"] for b in (1, 64)},
               **{f"decode_b{b}_share": decode["batch"][b]["tokens_per_s"]["median"] * fpt / peak_1 for b in (1, 64)}}
        if peer_python:
            side = lambda *a, **k: peer_side(peer_python, *a, **k)  # noqa: E731
            hf_dir = out / f"sizes-{hidden}-hf"
            hf_dir.mkdir(parents=True, exist_ok=True)

            (hf_dir / "config.json").write_text(json.dumps(hf_config(model.config)))
            theirs = peer_torch.theirs_train(side, hf_dir, steps, config.parallel.micro_batch_size,
                                             config.training.seq_length, out)
            row["torch_tokens_per_s"] = theirs["tokens_per_s"]
            row["vs_torch"] = train["tokens_per_s"] / theirs["tokens_per_s"]
        rows.append(row)
        print(f"[bench] sizes h={hidden}: train {row['train_tokens_per_s']:.0f} tok/s ({row['train_mfu']:.0%} of "
              f"the ceiling), decode b1 {row['decode_b1_tokens_per_s']:.0f} / b64 {row['decode_b64_tokens_per_s']:.0f}"
              f" tok/s ({row['decode_b64_share']:.0%})" + (f", {row['vs_torch']:.2f}x torch" if peer_python else ""),
              flush=True)
    return {"rows": rows, "steps": steps}


def markdown(r: dict | None) -> list[str]:
    if not r:
        return []
    torch = "torch_tokens_per_s" in r["rows"][0]
    lines = ["", "### Size sweep (the default depth; training: the project's step, both cores; decode: format 2, one "
                 "thread, 64 cached positions)", "",
             "| hidden | parameters | train tokens/s | train share of matmul ceiling | " + ("PyTorch tokens/s | ratio | "
                                                                                        if torch else "")
             + "decode ops | decode b1 tokens/s | decode b64 tokens/s | decode b64 share of one core's ceiling |",
             "|---|---|---|---|" + ("---|---|" if torch else "") + "---|---|---|---|"]
    for row in r["rows"]:
        lines.append(f"| {row['hidden']} | {row['parameters'] / 1e6:.1f}M | {row['train_tokens_per_s']:.0f} | "
                     f"{row['train_mfu']:.0%} of {row['matmul_peak_gflops']:.0f} GFLOP/s | "
                     + (f"{row['torch_tokens_per_s']:.0f} | {row['vs_torch']:.2f}x | " if torch else "")
                     + f"{row['decode_ops']} | {row['decode_b1_tokens_per_s']:.0f} | "
                       f"{row['decode_b64_tokens_per_s']:.0f} | {row['decode_b64_share']:.0%} of "
                       f"{row['one_thread_peak_gflops']:.0f} GFLOP/s |")
    return lines
