"""The export's static programs over the weights of the portable model (model/llama.py's cached step):

    model    (input_ids [B,T]) -> logits [B,T,V]    (positions 0..T-1, no padding: FullSequence)
    prefill  (input_ids [B,T], position_ids [B,T], key_mask [B,T])
             -> logits of the last position [B,V], keys [L,B,Hkv,T,D], values [L,B,Hkv,T,D]
    decode   (input_ids [B,1], position_ids [B,1], key_mask [B,P+1], past_keys_0..L-1 [B,Hkv,P,D] (one per layer),
              past_values_0..L-1) -> logits [B,V], new_keys [L,B,Hkv,1,D], new_values [L,B,Hkv,1,D], argmax [B]
              (export format 4: a greedy batch fetches the ids instead of the logits)
    extend   (input_ids [B,T], position_ids [B,T], key_mask [B,P+T], past_keys_0..L-1, past_values_0..L-1)
             -> logits of the last position [B,V], keys [L,B,Hkv,T,D], values (the T new tokens'): a prompt whose
             first P tokens' keys and values are cached (serving/engine/prefix_cache.py) runs only the rest
             (export format 3)

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
    """prefill / decode / extend .pdmodel (+ .pdiparams) next to the full-sequence graph."""
    ids, positions, mask, cache = _specs(model.config)
    _save(CachedLlamaStep(model, False), [ids, positions, mask], export_dir / exportdir.PREFILL_PREFIX)
    _save(CachedLlamaStep(model, True, extend=True), [ids, positions, mask, *cache],
          export_dir / exportdir.EXTEND_PREFIX)
    save_decode(model, export_dir / exportdir.DECODE_PREFIX)


def save_decode(model, prefix: Path, fused: bool = True, greedy: bool = True) -> None:
    """The decode program at `prefix`: export format 4's fused step with the argmax output, (greedy=False) format
    2-3's without it, or (fused=False, the bench's before) format 1's layer-by-layer CachedLlamaStep."""
    _, _, mask, cache = _specs(model.config)
    one = [paddle.static.InputSpec([None, 1], "int64", name) for name in (exportdir.FEED_NAME, exportdir.POSITIONS_NAME)]
    _save(FusedDecodeStep(model, greedy) if fused else CachedLlamaStep(model, True), [*one, mask, *cache], prefix)
    if fused:
        drop_identity_outputs(prefix)


def drop_identity_outputs(prefix: Path) -> int:
    """Remove the `scale(x, 1.0)` paddle.static.save_inference_model appends to every output
    (`save_infer_model/scale_<i>`, so that pruning keeps an activation's output: paddle/static/io.py, whose TODO asks
    for "an IR pass to remove 1-scale op"). Pruning is over once the program is saved; the fetch then reads the
    op's input. Three ops of a decode step that copy the logits and the new keys and values; returns how many went."""
    from paddle.base.proto import framework_pb2

    path = Path(f"{prefix}.pdmodel")
    program = framework_pb2.ProgramDesc.FromString(path.read_bytes())
    ops = program.blocks[0].ops
    source = {}
    for op in ops:
        attrs = {a.name: a for a in op.attrs}
        outputs = [name for o in op.outputs for name in o.arguments]
        if (op.type == "scale" and len(outputs) == 1 and outputs[0].startswith("save_infer_model/scale_")
                and attrs["scale"].f == 1.0 and attrs["bias"].f == 0.0):
            source[outputs[0]] = next(name for i in op.inputs if i.parameter == "X" for name in i.arguments)
    for op in ops:
        if op.type == "fetch":
            for i in op.inputs:
                i.arguments[:] = [source.get(name, name) for name in i.arguments]
    kept = [op for op in ops if not (op.type == "scale" and any(name in source for o in op.outputs
                                                                  for name in o.arguments))]
    del ops[:]
    ops.extend(kept)
    path.write_bytes(program.SerializeToString())
    return len(source)


def _specs(cfg) -> tuple:
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    ids = paddle.static.InputSpec([None, None], "int64", exportdir.FEED_NAME)
    positions = paddle.static.InputSpec([None, None], "int64", exportdir.POSITIONS_NAME)
    mask = paddle.static.InputSpec([None, None], "float32", exportdir.KEY_MASK_NAME)
    cache = [[paddle.static.InputSpec([None, cfg.num_key_value_heads, None, head_dim], "float32",
                                      exportdir.past_input(kind, layer)) for layer in range(cfg.num_hidden_layers)]
             for kind in exportdir.PAST_KINDS]
    return ids, positions, mask, cache


def _save(step, spec: list, prefix: Path) -> None:
    step.eval()
    paddle.jit.save(paddle.jit.to_static(step, input_spec=spec, full_graph=True), str(prefix))


def op_count(prefix: Path) -> int:
    """The ops a run of a saved program executes (feed and fetch left out): the figure that sets a decode step's time
    on CPU at small batches (~6 us an op)."""
    from paddle.base.proto import framework_pb2

    program = framework_pb2.ProgramDesc.FromString(Path(f"{prefix}.pdmodel").read_bytes())
    return sum(op.type not in ("feed", "fetch") for op in program.blocks[0].ops)
