"""Export's gates: every program it writes against the dynamic model, before anything is published.

    dynamic_references what the dynamic model computes for the two gates below, taken first: the model is freed
                       before any predictor is made, and the predictors are made one at a time
    logits_gate        the full-sequence graph (predictor plain and IR-optimised) and the prefill/decode programs
                       step by step (a left-padded batch): the worst logit difference <= export.parity_tolerance
                       times the logits' scale (max |logit|, at least 1): float32's error grows with the logits
    lora_merge_gate    a LoRA checkpoint merged into its base == PaddleNLP's LoRAModel over the base, as it trained
    tokens_gate        greedy tokens of the graph and the cache programs (alone and batched) == the dynamic model's
    fused_weights_gate a checkpoint trained with fused q/k/v or gate/up weights == its unfused form
    mlflow_model_gate  the MLflow model, loaded as MLflow loads it, generates the same tokens

Each predictor is serving's own (serving/engine/runtime.py): the gate checks what will be served.
"""
from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np

from core import REPO_ROOT, exportdir
from core.config import Config
from core.workarounds import heap
from export import ExportError, mlflow_model
from serving.engine.generation import StepLogits
from serving.engine.kv_cache import DecodeCache
from export.convert import dynamic_forward
from serving.engine import runtime
from serving.engine.exported import ExportedModel
from serving.protocol import GenerationSettings
from training.finetune.lora import LORA_CONFIG, as_trained

# Parity batches: (batch, sequence length) pairs of different shapes; 0 = the training sequence length.
PARITY_SHAPES = ((1, 5), (2, 17), (3, 0))


def fused_weights_gate(model, checkpoint: Path, config: Config) -> float | None:
    """A checkpoint trained with fused q/k/v or gate/up weights (performance.fuse_attention_qkv/ffn) is exported as
    the portable, unfused model (what the cache programs read); the fused model loaded as trained must give the
    same logits. None when the checkpoint is not fused."""
    from model.llama import is_fused, load_merged

    if not is_fused(checkpoint):
        return None
    trained = load_merged(checkpoint, portable=False)
    trained.eval()
    error = weight_layout_error(model, trained, model.config.vocab_size, config.training.seq_length)
    if error > config.export.parity_tolerance:
        raise ExportError(f"the unfused model of the fused checkpoint {checkpoint} differs from it by {error:.2e} > "
                          f"export.parity_tolerance; nothing was published")
    print(f"fused q/k/v / gate-up weights: exported unfused; max |unfused - fused as trained| = {error:.2e}",
          flush=True)
    return error


def lora_merge_gate(model, checkpoint: Path, config: Config) -> float | None:
    """A LoRA checkpoint is exported merged (training/finetune/lora.py merge_lora); the merged model must compute what
    PaddleNLP's LoRAModel computes over the base with the adapters unmerged, as it trained. A wrong merge (a
    transposed adapter, a wrong alpha / r scale, a weight trained whole left out) moves the logits by far more than
    float32's rounding. None when the checkpoint is not LoRA."""
    if not (Path(checkpoint) / LORA_CONFIG).is_file():
        return None
    trained = as_trained(checkpoint)
    error, scale = _max_logit_error(dynamic_forward(model), dynamic_forward(trained), model.config.vocab_size,
                                    config.training.seq_length, seed=3)
    relative, tolerance = error / max(1.0, scale), config.export.parity_tolerance
    if not relative <= tolerance:
        raise ExportError(f"the merged LoRA model differs from the adapters over the base as trained by {error:.2e} "
                          f"({relative:.2e} of the logits' scale {scale:.1f} > export.parity_tolerance {tolerance:.0e})"
                          f": a wrong merge; nothing was published")
    print(f"LoRA merge: max |merged - adapters over the base| = {error:.2e} ({relative:.2e} of the logits' scale "
          f"{scale:.1f}; tolerance {tolerance:.0e})", flush=True)
    return relative


def mlflow_model_gate(staging: Path, references: dict[str, list[int]]) -> None:
    """The export directory is also an MLflow `python_function` model (serving/offline/pyfunc.py); loaded as MLflow loads
    it, it must generate the references token for token."""
    mlflow_model.write(staging, mlflow_model.pinned_requirements(REPO_ROOT), exportdir.REFERENCE_PROMPTS[0])
    differ = mlflow_model.check(staging, references)
    if differ:
        raise ExportError(f"the MLflow pyfunc model generates other tokens than the exported graph for {differ}; "
                          f"nothing was published")
    print(f"MLflow model: python_function flavor; mlflow.pyfunc.load_model reproduces the greedy tokens of "
          f"{len(references)} prompts", flush=True)


class DynamicReferences(NamedTuple):
    """What the dynamic model computes for the logits and tokens gates, taken before any predictor is made so that
    the model is freed first: a 0.5B model (vocabulary 151,936) beside the three predictors the gates made was
    killed at 24.2 GB here."""
    parity: list[tuple[np.ndarray, np.ndarray]]  # (ids, logits) for each of PARITY_SHAPES
    cache: tuple[np.ndarray, np.ndarray, np.ndarray]  # cache_expectation's
    prompts: list[str]  # tokens_gate's prompts, their ids and the dynamic model's greedy tokens
    encoded: list[list[int]]
    tokens: list[list[int]]

    @property
    def scale(self) -> float:
        """max |logit| of the dynamic model over the parity batches."""
        return max(float(np.abs(logits).max()) for _, logits in self.parity)


def dynamic_references(model, staging: Path, config: Config, extra: tuple[str, ...] = ()) -> DynamicReferences:
    """The dynamic model's logits on the parity batches (seeded), on cache_parity_error's rows, and its greedy
    tokens for tokens_gate's prompts (`extra`: a fine-tuned model's held-out task prompts, rendered as chat). Reads
    the tokenizer and the limits from the export directory, as serving will."""
    vocab, seq_length, forward = model.config.vocab_size, config.training.seq_length, dynamic_forward(model)
    parity = [(ids, forward(ids)) for ids in parity_batches(vocab, seq_length, seed=0)]
    exported = ExportedModel(staging)
    prompts, encoded = greedy_prompts(exported, config, extra)
    tokens = [exported.generate(forward, ids, _greedy()) for ids in encoded]
    return DynamicReferences(parity, cache_expectation(forward, vocab, seq_length), prompts, encoded, tokens)


def logits_gate(expected: DynamicReferences, staging: Path, config: Config) -> dict:
    """Every exported program against the dynamic model: the full-sequence graph under both predictor
    configurations users run (plain, as served: bit-identical kernels; IR-optimised: fused passes change the
    arithmetic slightly) and the prefill/decode cache programs step by step, one predictor at a time. The gate takes
    the worst difference, relative to the logits' scale (max |logit| of the dynamic model on the parity batches, at
    least 1): float32's rounding grows with the logits (a fine-tuned model's confident logits put a correct export at
    2e-4 absolute, docs/finetune.md), a wrong program is off by the logits' own size. Returns the figures for
    export.json."""
    full = 0.0
    for ir_optim in (False, True):
        full = max(full, parity_error(expected.parity, runtime.create_predictor(staging, ir_optim)))
        heap.release()  # (the predictor's weights and activations, before the next one: core/workarounds/heap.py)
    session = runtime.cache_session(staging)
    cached = max(cache_parity_error(expected.cache, *session),
                 extend_parity_error(expected.cache, session[0], runtime.extend_session(staging)))
    del session
    heap.release()
    scale = expected.scale
    error, tolerance = max(full, cached), config.export.parity_tolerance
    relative = error / max(1.0, scale)
    print(f"parity: max |dynamic - paddle.inference| = {full:.3e} (full graph, shapes {PARITY_SHAPES}, "
          f"ir_optim off/on), {cached:.3e} (prefill + decode, and extend at every block split, padded batch); "
          f"logits' scale {scale:.1f}: "
          f"{relative:.2e} relative (tolerance {tolerance:.0e})", flush=True)
    if not relative <= tolerance:
        raise ExportError(f"parity check failed: max logit difference {error:.3e} = {relative:.2e} of the logits' "
                          f"scale {scale:.1f} > export.parity_tolerance {tolerance:.0e}; nothing was published")
    return {"parity_max_abs_error": error, "parity_logit_scale": scale, "parity_relative_error": relative}


def greedy_prompts(exported, config: Config, extra: tuple[str, ...]) -> tuple[list[str], list[list[int]]]:
    """tokens_gate's prompts and their ids: the reference prompts, longer ones up to the serving prompt limit, and
    `extra`, encoded as serving encodes (no special tokens)."""
    text = "".join(exportdir.REFERENCE_PROMPTS) * 16
    room = exported.max_length - exportdir.REFERENCE_NEW_TOKENS - 1  # (tokens: a model's own BPE may spend
    limit = min(config.serving.max_prompt_chars, room)                 # several on one character)
    prompts = [*exportdir.REFERENCE_PROMPTS, text[:limit // 3], text[:limit], *extra]
    return prompts, [exported.tokenizer(p, add_special_tokens=False)["input_ids"][:room] or exported.encode(p)
                     for p in prompts]


def _greedy():
    return GenerationSettings(max_new_tokens=exportdir.REFERENCE_NEW_TOKENS)


def tokens_gate(expected: DynamicReferences, staging: Path) -> dict[str, list[int]]:
    """Greedy continuations: the cache programs (each prompt alone, and all of them in one batch of mixed lengths)
    and the full graph must produce the dynamic model's tokens exactly (dynamic_references' prompts), one set of
    predictors at a time. The reference prompts' tokens are stored (reference.json) so that smoke can check a
    running server without the checkpoint."""
    exported, settings, encoded = ExportedModel(staging), _greedy(), expected.encoded
    session = exported.cached_session()
    paths = {"cache programs": [exported.generate_batch(session, [ids], [settings])[0] for ids in encoded],
             "cache programs, batched": exported.generate_batch(session, encoded, [settings] * len(encoded))}
    del session
    heap.release()
    predictor = runtime.create_predictor(staging)
    paths["exported graph"] = [exported.generate(lambda x: runtime.predict(predictor, x), ids, settings)
                               for ids in encoded]
    del predictor
    heap.release()
    for path, got in paths.items():
        for prompt, a, b in zip(expected.prompts, got, expected.tokens):
            if a != b:
                raise ExportError(f"parity check failed: greedy tokens of the {path} for {prompt[:20]!r} "
                                  f"({len(prompt)} chars) are {a}, the dynamic model's {b}; nothing was published")
    print(f"greedy tokens: exported graph == cache programs (alone and batched) == dynamic model for "
          f"{len(encoded)} prompts of {min(map(len, encoded))}-{max(map(len, encoded))} tokens", flush=True)
    return dict(zip(exportdir.REFERENCE_PROMPTS, expected.tokens))


def parity_error(parity: list[tuple[np.ndarray, np.ndarray]], predictor) -> float:
    """Max |dynamic - paddle.inference| logit difference over the parity batches ((ids, the dynamic model's logits))."""
    return max(float(np.abs(runtime.predict(predictor, ids) - logits).max()) for ids, logits in parity)


def weight_layout_error(portable, trained, vocab: int, seq_length: int, seed: int = 2) -> float:
    """Max |portable - as trained| logit difference: a checkpoint trained with fused q/k/v or gate/up weights is
    exported as the unfused model (PaddleNLP splits the weights on load); both must compute the same function."""
    return _max_logit_error(dynamic_forward(portable), dynamic_forward(trained), vocab, seq_length, seed)[0]


def parity_batches(vocab: int, seq_length: int, seed: int) -> list[np.ndarray]:
    """Seeded random ids [batch, length] for each of PARITY_SHAPES (length 0: the training sequence length)."""
    rng = np.random.RandomState(seed)
    return [rng.randint(5, vocab, size=(batch, length or seq_length)).astype("int64") for batch, length in PARITY_SHAPES]


def _max_logit_error(a, b, vocab: int, seq_length: int, seed: int) -> tuple[float, float]:
    """(max |a(ids) - b(ids)|, max |b(ids)|) over seeded random batches of PARITY_SHAPES."""
    worst, scale = 0.0, 0.0
    for ids in parity_batches(vocab, seq_length, seed):
        reference = b(ids)
        worst, scale = max(worst, float(np.abs(a(ids) - reference).max())), max(scale, float(np.abs(reference).max()))
    return worst, scale


CACHE_PAD = 3  # cache_parity_error's second row is left-padded by this many tokens


def cache_expectation(forward, vocab: int, seq_length: int, seed: int = 1) -> tuple[np.ndarray, ...]:
    """cache_parity_error's rows (ids [2, max(8, seq_length)], seeded) and the dynamic forward's logits of each: the
    first row whole, the second without its first CACHE_PAD tokens (it is fed left-padded)."""
    ids = np.random.RandomState(seed).randint(5, vocab, size=(2, max(8, seq_length))).astype("int64")
    return ids, forward(ids[:1])[0], forward(ids[1:, CACHE_PAD:])[0]


def cache_parity_error(expected: tuple[np.ndarray, ...], prefill, decode) -> float:
    """Max |dynamic - cache programs| logit difference (prefill, decode: runtime.cache_session) on cache_expectation's
    two rows (the second left-padded by CACHE_PAD), the first half of the sequence through prefill, the rest one
    decode step at a time, each step against the full dynamic forward."""
    ids, first, second = expected
    pad, length = CACHE_PAD, ids.shape[1]
    half = length // 2
    prompt, positions, mask = _padded_prompt(ids, half)
    logits, keys, values = prefill(prompt, positions, mask)
    cache = DecodeCache(keys, values, mask, np.array([half, half - pad], dtype="int64"))  # (positions t and t - pad)
    worst = max(float(np.abs(logits[0] - first[half - 1]).max()), float(np.abs(logits[1] - second[half - 1 - pad]).max()))
    for t in range(half, length):
        logits = decode(ids[:, t:t + 1], cache)
        worst = max(worst, float(np.abs(logits[0] - first[t]).max()), float(np.abs(logits[1] - second[t - pad]).max()))
        if isinstance(logits, StepLogits) and not np.array_equal(logits.greedy, logits.full().argmax(axis=1)):
            return float("inf")  # (format 4's argmax output is not its logits' argmax)
    return worst


def _padded_prompt(ids: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """cache_expectation's rows cut to `width` as a prefill takes them: (ids, positions, mask), the second row's first
    CACHE_PAD tokens padded."""
    pad = CACHE_PAD
    prompt, mask = ids[:, :width].copy(), np.ones((2, width), "float32")
    positions = np.tile(np.arange(width), (2, 1)).astype("int64")
    prompt[1, :pad], mask[1, :pad], positions[1] = 0, 0.0, np.maximum(np.arange(width) - pad, 0)
    return prompt, positions, mask


EXTEND_BLOCK = 8  # extend_parity_error splits the prompt at every multiple of this (serving.prefix_block_tokens)


def extend_parity_error(expected: tuple[np.ndarray, ...], prefill, extend) -> float:
    """Max |prefill - extend| on cache_expectation's two rows (the second left-padded) as one prompt, split after
    the first token, at every multiple of EXTEND_BLOCK and before the last token: the first part through prefill,
    the rest through extend over its keys and values (runtime.extend_session); the last logits and the real
    tokens' keys and values against the whole prompt's prefill (a pad's keys are masked, whatever they hold)."""
    ids = expected[0]
    prompt, positions, mask = _padded_prompt(ids, ids.shape[1])
    full = prefill(prompt, positions, mask)
    width, real = prompt.shape[1], mask == 1
    worst = 0.0
    for split in sorted({1, width - 1, *range(EXTEND_BLOCK, width - 1, EXTEND_BLOCK)}):
        _, keys, values = prefill(prompt[:, :split], positions[:, :split], mask[:, :split])
        logits, new_keys, new_values = extend(prompt[:, split:], positions[:, split:], mask, keys, values)
        worst = max(worst, float(np.abs(logits - full[0]).max()))
        for got, whole in ((new_keys, full[1]), (new_values, full[2])):
            worst = max(worst, float(np.abs(got - whole[:, :, :, split:]).transpose(1, 3, 0, 2, 4)[real[:, split:]]
                                     .max()))
    return worst
