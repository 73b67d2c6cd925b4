"""The export's static programs over the weights of the portable model (model/llama.py's cached step):

    model    (input_ids [B,T]) -> logits [B,T,V]    (positions 0..T-1, no padding: FullSequence)
    prefill  (input_ids [B,T], position_ids [B,T], key_mask [B,T])
             -> logits of the last position [B,V], keys [L,B,Hkv,T,D], values [L,B,Hkv,T,D]
    decode   (input_ids [B,1], position_ids [B,1], key_mask [B,P+1], past_keys_0..L-1 [B,Hkv,P,D] (one per layer),
              past_values_0..L-1) -> logits [B,V], new_keys [L,B,Hkv,1,D], new_values [L,B,Hkv,1,D]

A decode step costs O(P) attention instead of re-running the whole sequence. Input and file names are the export
directory's (core/exportdir.py). The decode program is model/decode.py's step over fused weights (export format 2);
prefill and the full sequence run CachedLlamaStep, the model's own layers (once a request: their op count matters
little).
"""
from __future__ import annotations

from pathlib import Path

import core  # noqa: F401  (zlib before paddle)
import paddle  # noqa: E402

from core import exportdir  # noqa: E402
from model.decode import FusedDecodeStep  # noqa: E402
from model.llama import CachedLlamaStep, FullSequence  # noqa: E402


def save_full_sequence(model, export_dir: Path) -> None:
    full = FullSequence(model)
    full.eval()
    spec = [paddle.static.InputSpec([None, None], "int64", exportdir.FEED_NAME)]
    paddle.jit.save(paddle.jit.to_static(full, input_spec=spec, full_graph=True),
                    str(export_dir / exportdir.MODEL_PREFIX))


def save_programs(model, export_dir: Path) -> None:
    """prefill.pdmodel / decode.pdmodel (+ .pdiparams) next to the full-sequence graph."""
    cfg = model.config
    layers, kv_heads = cfg.num_hidden_layers, cfg.num_key_value_heads
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    ids = paddle.static.InputSpec([None, None], "int64", exportdir.FEED_NAME)
    positions = paddle.static.InputSpec([None, None], "int64", exportdir.POSITIONS_NAME)
    mask = paddle.static.InputSpec([None, None], "float32", exportdir.KEY_MASK_NAME)
    cache = [[paddle.static.InputSpec([None, kv_heads, None, head_dim], "float32", exportdir.past_input(kind, layer))
              for layer in range(layers)] for kind in exportdir.PAST_KINDS]
    one = [paddle.static.InputSpec([None, 1], "int64", name) for name in (exportdir.FEED_NAME, exportdir.POSITIONS_NAME)]
    for prefix, step, spec in ((exportdir.PREFILL_PREFIX, CachedLlamaStep(model, False), [ids, positions, mask]),
                               (exportdir.DECODE_PREFIX, FusedDecodeStep(model), [*one, mask, *cache])):
        step.eval()
        static = paddle.jit.to_static(step, input_spec=spec, full_graph=True)
        paddle.jit.save(static, str(export_dir / prefix))


def op_count(prefix: Path) -> int:
    """The ops a run of a saved program executes (feed and fetch left out): the figure that sets a decode step's time
    on CPU at small batches (~6 us an op)."""
    from paddle.base.proto import framework_pb2

    program = framework_pb2.ProgramDesc.FromString(Path(f"{prefix}.pdmodel").read_bytes())
    return sum(op.type not in ("feed", "fetch") for op in program.blocks[0].ops)
