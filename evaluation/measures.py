"""What a version is measured by, in process: losses of the exported graph, its greedy answers to a task's prompts
and to fixed prompts (graded by grading.py)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from core import exportdir
from serving.engine import runtime
from serving.engine.exported import ExportedModel
from serving.protocol import GenerationSettings
from training.finetune.data import IGNORE

PROMPTS = ("人工智能", "这本书", "快递很快，", "价格便宜", "我们今天", "手机很好用", "质量不错，", "服务态度")
NEW_TOKENS = 32
BATCH = 16


def token_loss(export_dir: Path, blocks: np.ndarray) -> tuple[float, int]:
    """Token-weighted cross-entropy of the exported graph over blocks (inputs block[:-1], labels block[1:])."""
    predictor = runtime.create_predictor(export_dir)
    total, count = 0.0, 0
    for start in range(0, len(blocks), BATCH):
        batch = blocks[start:start + BATCH]
        summed, n = _loss_sum(predictor, batch[:, :-1], batch[:, 1:], np.ones(batch[:, 1:].shape, dtype=bool))
        total, count = total + summed, count + n
    return total / count, count


def answer_loss(export_dir: Path, rows: np.ndarray) -> tuple[float, int]:
    """Cross-entropy of the exported graph on the answer tokens of fine-tuning examples ([N, 2, L]: input ids,
    labels with -100 where nothing is learned), token-weighted: the eval_loss fine-tuning reports."""
    predictor = runtime.create_predictor(export_dir)
    total, count = 0.0, 0
    for start in range(0, len(rows), BATCH):
        ids, labels = rows[start:start + BATCH, 0].astype(np.int64), rows[start:start + BATCH, 1]
        summed, n = _loss_sum(predictor, ids, labels, labels != IGNORE)
        total, count = total + summed, count + n
    return total / max(count, 1), count


def _loss_sum(predictor, ids: np.ndarray, labels: np.ndarray, learned: np.ndarray) -> tuple[float, int]:
    """Summed cross-entropy of the exported graph's logits for `ids` at the `learned` positions of `labels`."""
    logits = runtime.predict(predictor, ids).astype(np.float64)
    top = logits.max(axis=-1, keepdims=True)
    logz = np.log(np.exp(logits - top).sum(axis=-1)) + top[..., 0]
    picked = np.take_along_axis(logits, np.where(learned, labels, 0)[..., None], axis=-1)[..., 0]
    return float((logz - picked)[learned].sum()), int(learned.sum())


def greedy_answers(export_dir: Path, prompts: list[str], new_tokens: int = 8, batch_size: int = BATCH) -> list[str]:
    """The exported model's greedy answers to rendered prompts (as the chat route renders them), in process."""
    model = ExportedModel(export_dir)
    session = model.cached_session()
    settings = GenerationSettings(max_new_tokens=new_tokens)
    answers = []
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start:start + batch_size]
        new = model.generate_batch(session, [model.encode(p) for p in batch], [settings] * len(batch))
        answers += [model.decode(ids).strip() for ids in new]
    return answers


def generate_prompts(export_dir: Path) -> list[dict]:
    """PROMPTS, greedy, NEW_TOKENS each, through the served generation path (the cache programs, or the full graph of
    an export without them)."""
    model = ExportedModel(export_dir)
    session = model.cached_session() if exportdir.has_cache_programs(export_dir) else None
    prompts = [model.encode(p) for p in PROMPTS]
    settings = [GenerationSettings(max_new_tokens=NEW_TOKENS)] * len(prompts)
    if session is not None:
        new = model.generate_batch(session, prompts, settings)
    else:
        predictor = runtime.create_predictor(export_dir)
        new = [model.generate(lambda ids: runtime.predict(predictor, ids), p, s) for p, s in zip(prompts, settings)]
    return [{"prompt": p, "text": model.decode(ids), "token_ids": [i for i in ids if i != model.eos_id]}
            for p, ids in zip(PROMPTS, new)]
