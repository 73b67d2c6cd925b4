"""The vLLM side of `make bench PEERS=vllm` (bench/peer_vllm.py), run by the peer environment's Python: it imports
vLLM, torch and transformers, and nothing of this project (no Paddle there).

    logits   --hf DIR --ids IDS.json --out OUT.npz      transformers' LlamaForCausalLM logits of each id sequence
    generate --hf DIR --prompts P.jsonl --out OUT.json   vLLM's `LLM.generate` over the prompts (greedy, ignoring
                                                         nothing: it stops at the end token as the project does),
                                                         timed after the engine has loaded and warmed up
    train    --hf DIR --steps N --batch B --seq T         PyTorch eager training of the same architecture
                                                         (LlamaForCausalLM from config.json, AdamW, B x T tokens of
                                                         random ids a step): median step time after two warm-up steps
"""
from __future__ import annotations

import argparse
import json
import time
import statistics
import numpy as np


def logits(hf_dir: str, ids_path: str, out: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    arrays = {}
    with torch.no_grad():
        for i, ids in enumerate(json.loads(open(ids_path, encoding="utf-8").read())):
            arrays[f"s{i}"] = model(torch.tensor([ids])).logits[0].numpy()
    np.savez(out, **arrays)


def generate(hf_dir: str, prompts_path: str, out: str, max_model_len: int) -> None:
    from vllm import LLM, SamplingParams

    rows = [json.loads(line) for line in open(prompts_path, encoding="utf-8") if line.strip()]
    t0 = time.perf_counter()
    llm = LLM(model=hf_dir, dtype="float32", max_model_len=max_model_len, seed=0)
    load_s = time.perf_counter() - t0
    params = [SamplingParams(temperature=0.0, max_tokens=r["max_new_tokens"]) for r in rows]
    llm.generate([r["prompt"] for r in rows[:8]], params[:8], use_tqdm=False)  # (warm-up: compiled graphs)
    t0 = time.perf_counter()
    outputs = llm.generate([r["prompt"] for r in rows], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    tokens = sum(len(t) for t in token_ids)
    json.dump({"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "load_s": load_s,
               "token_ids": token_ids, "prompt_token_ids": [list(o.prompt_token_ids) for o in outputs]},
              open(out, "w", encoding="utf-8"))


def train(hf_dir: str, steps: int, batch: int, seq: int, out: str) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    ids = torch.randint(5, config.vocab_size, (steps + 2, batch, seq + 1))
    times = []
    for step in range(steps + 2):
        t0 = time.perf_counter()
        loss = model(input_ids=ids[step, :, :-1], labels=ids[step, :, 1:]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        float(loss)
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times[2:])
    json.dump({"step_s": step_s, "tokens_per_s": batch * seq / step_s, "threads": torch.get_num_threads(),
               "torch": torch.__version__}, open(out, "w"))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=("logits", "generate", "train"))
    p.add_argument("--hf", required=True)
    p.add_argument("--ids", default="")
    p.add_argument("--prompts", default="")
    p.add_argument("--out", required=True)
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=64)
    args = p.parse_args()
    if args.mode == "logits":
        logits(args.hf, args.ids, args.out)
    elif args.mode == "train":
        train(args.hf, args.steps, args.batch, args.seq, args.out)
    else:
        generate(args.hf, args.prompts, args.out, args.max_model_len)


if __name__ == "__main__":
    main()
