"""The training side of `make bench PEERS=vllm`: the project's step (bench/training_speed.py, the default runtime
settings) against PyTorch eager on the same architecture and batch (LlamaForCausalLM from the HF config.json, AdamW;
bench/peer_vllm_side.py train, with the peer environment's PyTorch), each trial in a fresh process, in the peer's
alternating rounds; with the ceiling: every core at the fp32 matmul peak measured in the trials."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from bench import spread
from bench.training_speed import SETTINGS, trial


def ours_train(run_dir: Path, steps: int, out: Path) -> dict:
    return trial(run_dir, list(SETTINGS)[-1], steps, out / "scratch")  # (the last setting: the project's default)


def theirs_train(side, hf_dir: Path, steps: int, batch: int, seq: int, out: Path) -> dict:
    """`side(*args, log_path)`: bench/peer_vllm_side.py with the peer environment's Python (bench/peer_vllm.py)."""
    side("train", "--hf", str(hf_dir), "--steps", str(steps), "--batch", str(batch), "--seq", str(seq),
         "--out", str(out / "peer-train.json"), log_path=out / "peer.log")
    return json.loads((out / "peer-train.json").read_text())


def summarise(train: dict) -> dict:
    """{ours, torch: median [min-max] tokens/s, ratio, ratio_by_round (paired), the ceiling and MFU}."""
    training = {who: spread([t["tokens_per_s"] for t in trials]) for who, trials in train.items()}
    training["ratio"] = training["ours"]["median"] / training["torch"]["median"]
    training["ratio_by_round"] = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(train["ours"], train["torch"])]
    ours = train["ours"]
    # the ceiling: every core at the fp32 matmul peak measured in the trials, at the model's FLOPs per token
    training["flops_per_token"] = ours[0]["flops_per_token"]
    training["matmul_peak_gflops"] = statistics.median(t["matmul_peak_gflops"] for t in ours)
    training["mfu"] = statistics.median(t["mfu"] for t in ours)
    training["ceiling_tokens_per_s"] = training["matmul_peak_gflops"] * 1e9 / training["flops_per_token"]
    return training


def markdown(t: dict | None) -> list[str]:
    if not t:
        return []
    fmt = lambda s: f"{s['median']:.0f} [{s['min']:.0f}-{s['max']:.0f}]"  # noqa: E731
    rounds = " / ".join(f"{x:.2f}" for x in t.get("ratio_by_round", []))
    return ["| training, the default model and batch | tokens/s |", "|---|---|",
            f"| this project's step | {fmt(t['ours'])} |", f"| PyTorch eager (same architecture, AdamW) | "
            f"{fmt(t['torch'])} |", f"| ratio | **{t['ratio']:.2f}x** (rounds: {rounds}) |", "",
            f"Ceiling: {t['flops_per_token'] / 1e6:.1f} MFLOP a trained token (6N + 12Lhs) against the fp32 matmul "
            f"peak measured in the trials ({t['matmul_peak_gflops']:.0f} GFLOP/s with the trial's threads) = "
            f"{t['ceiling_tokens_per_s']:.0f} tokens/s; this project's step is at {t['mfu']:.0%} of it.", ""]
