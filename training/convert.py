"""Export's training-side library: a unified checkpoint -> the dynamic model -> a static graph (`paddle.jit.save`)
-> its parity with the dynamic model under paddle.inference. File names and the predictor come from the export
directory contract (core/exportdir.py); selecting, publishing and registering are the export verb's
(pipeline/export.py)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from core import exportdir
from core.errors import ConfigError

# Parity batches: (batch, sequence length) pairs of different shapes; 0 = the training sequence length.
PARITY_SHAPES = ((1, 5), (2, 17), (3, 0))


def load_checkpoint(checkpoint: Path):
    """The single-device dynamic model of a unified (full-tensor) checkpoint of any layout, in eval mode."""
    import paddle

    from training.model import load_merged

    paddle.set_device("cpu")
    try:
        model = load_merged(checkpoint)
    except Exception as exc:  # noqa: BLE001  (safetensors / json / paddle errors on a damaged checkpoint)
        raise ConfigError(f"checkpoint {checkpoint} is unreadable ({exc.__class__.__name__}: "
                          f"{str(exc).splitlines()[0][:200] if str(exc) else ''}); pick another run or RUN_ID") from None
    model.eval()
    return model


def logits_only(model):
    import paddle

    class LogitsOnly(paddle.nn.Layer):
        """input_ids -> logits (the model itself returns a tuple / ModelOutput)."""

        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids):
            return self.inner(input_ids, use_cache=False, return_dict=False)[0]

    return LogitsOnly(model)


def dynamic_forward(model):
    """forward(ids[B, T]) -> logits[B, T, V] of the dynamic model, as numpy (what generation drives)."""
    import paddle

    def forward(ids: np.ndarray) -> np.ndarray:
        with paddle.no_grad():
            return logits_only(model)(paddle.to_tensor(ids)).numpy()

    return forward


def save_static(model, export_dir: Path) -> None:
    """model.pdmodel: input_ids -> logits (training/kv_cache.py FullSequence)."""
    from training import kv_cache
    kv_cache.save_full_sequence(model, export_dir)


def parity_error(model, predictor, vocab: int, seq_length: int, seed: int = 0) -> float:
    """Max |dynamic - paddle.inference| logit difference over batches of different shapes."""
    return _max_logit_error(dynamic_forward(model), lambda ids: exportdir.predict(predictor, ids), vocab, seq_length,
                            seed)


def weight_layout_error(portable, trained, vocab: int, seq_length: int, seed: int = 2) -> float:
    """Max |portable - as trained| logit difference: a checkpoint trained with fused q/k/v or gate/up weights is
    exported as the unfused model (PaddleNLP splits the weights on load); both must compute the same function."""
    return _max_logit_error(dynamic_forward(portable), dynamic_forward(trained), vocab, seq_length, seed)


def _max_logit_error(a, b, vocab: int, seq_length: int, seed: int) -> float:
    """Max |a(ids) - b(ids)| over seeded random batches of PARITY_SHAPES."""
    rng = np.random.RandomState(seed)
    worst = 0.0
    for batch, length in PARITY_SHAPES:
        ids = rng.randint(5, vocab, size=(batch, length or seq_length)).astype("int64")
        worst = max(worst, float(np.abs(a(ids) - b(ids)).max()))
    return worst


def save_cache_programs(model, export_dir: Path) -> None:
    from training import kv_cache
    kv_cache.save_programs(model, export_dir)


def cache_parity_error(model, prefill, decode, vocab: int, seq_length: int, seed: int = 1) -> float:
    """Max |dynamic - cache programs| logit difference (prefill, decode: exportdir.cache_session): two rows (the
    second left-padded by 3), the first half of the sequence through prefill, the rest one decode step at a time,
    each step against the full dynamic forward."""
    rng = np.random.RandomState(seed)
    length, pad = max(8, seq_length), 3
    ids = rng.randint(5, vocab, size=(2, length)).astype("int64")
    forward = dynamic_forward(model)
    expected = [forward(ids[:1]), forward(ids[1:, pad:])]  # row 1 is shorter by `pad` tokens
    half = length // 2
    prompt, mask = ids[:, :half].copy(), np.ones((2, half), "float32")
    positions = np.tile(np.arange(half), (2, 1)).astype("int64")
    prompt[1, :pad], mask[1, :pad], positions[1] = 0, 0.0, np.maximum(np.arange(half) - pad, 0)
    logits, keys, values = prefill(prompt, positions, mask)
    worst = max(float(np.abs(logits[0] - expected[0][0, half - 1]).max()),
                float(np.abs(logits[1] - expected[1][0, half - 1 - pad]).max()))
    for t in range(half, length):
        mask = np.concatenate([mask, np.ones((2, 1), "float32")], axis=1)
        step_positions = np.array([[t], [t - pad]], dtype="int64")
        logits, keys, values = decode(ids[:, t:t + 1], step_positions, mask, keys, values)
        worst = max(worst, float(np.abs(logits[0] - expected[0][0, t]).max()),
                    float(np.abs(logits[1] - expected[1][0, t - pad]).max()))
    return worst
