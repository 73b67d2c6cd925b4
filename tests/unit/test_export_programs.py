"""export/programs.py's cache programs on a small random model with grouped-query attention (the trained
fixtures have as many key/value heads as query heads): prefill + decode step by step equal the dynamic model, and
the decode program returns only the new token's keys and values (serving/engine/runtime.py appends them)."""
import numpy as np

import core  # noqa: F401  (zlib before paddle)
import paddle  # noqa: E402

from bench import decode_step  # noqa: E402
from core import exportdir  # noqa: E402
from export import gates, programs  # noqa: E402
from export.convert import dynamic_forward  # noqa: E402
from serving.engine import kv_cache, runtime  # noqa: E402
from serving.engine.kv_cache import DecodeCache  # noqa: E402


def random_model(seed: int, vocab: int, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
                 max_positions: int):
    """A random Llama whose norm weights are not all 1 (the decode program folds them into its matmuls), and its
    config."""
    model = decode_step.random_model(hidden, layers, heads, intermediate, vocab, max_positions, kv_heads, seed,
                                     varied_norms=True)
    return model, model.config


def exported_gqa_model(export_dir, seed: int):
    """A small random Llama with grouped-query attention, its cache programs saved in `export_dir`."""
    model, config = random_model(seed, vocab=96, hidden=32, intermediate=64, layers=2, heads=4, kv_heads=2,
                                 max_positions=64)
    programs.save_programs(model, export_dir)
    return model, config


def test_the_decode_program_of_the_default_model_runs_at_most_140_ops(tmp_path):
    """Export format 2's decode step (model/decode.py) on the default model's shape (configs/tiny.yaml, a smaller
    vocabulary): q/k/v and gate/up each one matmul, no casts, and the same logits and keys as the
    layer-by-layer step (CachedLlamaStep) it replaced, which ran 267 ops."""
    from collections import Counter

    from paddle.base.proto import framework_pb2

    from core.config import DEFAULT_CONFIG, load_config
    from model.llama import CachedLlamaStep

    m = load_config(DEFAULT_CONFIG).model
    model, config = random_model(5, vocab=512, hidden=m.hidden_size, intermediate=m.intermediate_size,
                                 layers=m.num_layers, heads=m.num_attention_heads, kv_heads=m.num_key_value_heads,
                                 max_positions=m.max_position_embeddings)
    prefix = tmp_path / exportdir.DECODE_PREFIX
    programs.save_decode(model, prefix)  # (the decode program alone: the prefill's conversion took half the test)
    program = framework_pb2.ProgramDesc.FromString(prefix.with_suffix(".pdmodel").read_bytes())
    ops = Counter(op.type for op in program.blocks[0].ops if op.type not in ("feed", "fetch"))
    assert programs.op_count(prefix) == sum(ops.values()) <= 140, ops
    # no casts; the rotary tables expanded over the heads once a step (2), not in every layer (16 before); none of
    # the identity scales paddle.jit.save appends to the outputs
    assert "cast" not in ops and ops["expand_as_v2"] == 2 and ops["scale"] == 1, ops
    # per layer: the fused q/k/v and gate/up matmuls and two attention matmuls, o and down as addmm (with the norms'
    # means); the last matmul is the head
    assert ops["matmul_v2"] == 5 * m.num_layers + 1 and ops["addmm"] == 4 * m.num_layers + 1, ops

    rng = np.random.default_rng(0)
    batch, past, layers = 3, 7, m.num_layers
    d = m.hidden_size // m.num_attention_heads
    ids, positions = rng.integers(0, 512, (batch, 1)), np.array([[7], [6], [5]])
    mask = np.ones((batch, past + 1), "float32")
    mask[1, :1], mask[2, :2] = 0, 0  # (left padding)
    caches = [rng.standard_normal((batch, m.num_key_value_heads, past, d)).astype("float32")
              for _ in range(2 * layers)]
    ours = runtime.run(runtime.create_predictor(tmp_path, prefix=exportdir.DECODE_PREFIX), ids, positions, mask,
                       *caches)
    step = CachedLlamaStep(model, with_past=True)
    with paddle.no_grad():
        theirs = step(*(paddle.to_tensor(x) for x in (ids, positions, mask)),
                      [paddle.to_tensor(c) for c in caches[:layers]], [paddle.to_tensor(c) for c in caches[layers:]])
    for a, b in zip(ours, theirs):
        b = b.numpy()
        assert a.shape == b.shape and np.abs(a - b).max() < 1e-5 * np.abs(b).max(), (a.shape, np.abs(a - b).max())


def test_cache_programs_with_grouped_query_attention_match_the_dynamic_model(tmp_path):
    model, config = exported_gqa_model(tmp_path, 3)

    decode = runtime.create_predictor(tmp_path, prefix=exportdir.DECODE_PREFIX)
    assert decode.get_input_names() == ["input_ids", "position_ids", "key_mask", "past_keys_0", "past_keys_1",
                                        "past_values_0", "past_values_1"]
    prefill, step = runtime.cache_session(tmp_path)
    ids, positions, mask = np.array([[5, 6, 7]]), np.array([[0, 1, 2]]), np.ones((1, 3), "float32")
    _, keys, values = prefill(ids, positions, mask)
    assert keys.shape == values.shape == (2, 1, 2, 3, 8)  # [layers, batch, key/value heads, positions, head dim]
    cache = DecodeCache(keys, values, mask, np.array([3]))
    step(np.array([[9]]), cache)
    assert cache.keys.shape == (2, 1, 2, 4, 8) and np.array_equal(cache.keys[:, :, :, :3], keys)

    # two rows, one left-padded, 12 decode steps each checked against the dynamic model's logits
    expected = gates.cache_expectation(dynamic_forward(model), config.vocab_size, 40)
    error = gates.cache_parity_error(expected, prefill, step)
    assert error < 1e-4, error

    # the extend program (format 3): a prompt split at 1, every 8 and 39 tokens, the first part's keys and values
    # cached, equals the whole prompt's prefill; one that ignored the cached part would be off by ~0.1
    extend = runtime.extend_session(tmp_path)
    assert gates.extend_parity_error(expected, prefill, extend) < 1e-4
    forgetful = lambda ids, positions, mask, keys, values: extend(  # noqa: E731
        ids, positions, np.concatenate([0 * mask[:, :keys.shape[3]], mask[:, keys.shape[3]:]], axis=1), keys, values)
    assert gates.extend_parity_error(expected, prefill, forgetful) > 1e-2


def test_decode_steps_across_cache_growth_equal_the_dynamic_model(tmp_path, monkeypatch):
    """The decode cache grows in buffers (serving/engine/kv_cache.py); with room for 3 columns at a time, 12 steps
    cross four growths and still equal the dynamic model."""
    monkeypatch.setattr(kv_cache, "GROW", 3)
    model, config = exported_gqa_model(tmp_path, 4)
    prefill, step = runtime.cache_session(tmp_path)
    assert gates.cache_parity_error(gates.cache_expectation(dynamic_forward(model), config.vocab_size, 24), prefill,
                                    step) < 1e-4


def test_the_decode_program_reads_the_cache_in_place_and_leaves_it_as_it_was(tmp_path):
    """runtime.cache_session shares the cache's buffers with the predictor (no copy a step): the same logits and new
    columns as feeding copies, and the columns it read are bit for bit what they were (no op of the program writes
    into an input, memory optimisation on)."""
    exported_gqa_model(tmp_path, 6)
    (prefill, shared), (_, copied) = runtime.cache_session(tmp_path), runtime.cache_session(tmp_path, zero_copy=False)
    ids, positions, mask = np.array([[5, 6, 7, 8], [0, 9, 10, 11]]), np.array([[0, 1, 2, 3], [0, 0, 1, 2]]), \
        np.array([[1, 1, 1, 1], [0, 1, 1, 1]], "float32")
    _, keys, values = prefill(ids, positions, mask)
    caches = [DecodeCache(keys, values, mask, np.array([4, 3])) for _ in range(2)]
    for step in range(5):
        before = caches[0].keys.copy(), caches[0].values.copy()
        tokens = np.array([[12 + step], [20 + step]])
        a, b = shared(tokens, caches[0]), copied(tokens, caches[1])
        assert np.array_equal(a.full(), b.full()) and np.array_equal(a.greedy, b.greedy)
        assert np.array_equal(a.greedy, a.full().argmax(axis=1))  # (export format 4's argmax output)
        assert np.array_equal(caches[0].keys[:, :, :, :-1], before[0])
        assert np.array_equal(caches[0].values[:, :, :, :-1], before[1])
        assert np.array_equal(caches[0].keys, caches[1].keys) and np.array_equal(caches[0].values, caches[1].values)


def test_the_decode_cache_feeds_its_buffers_and_writes_one_column_a_step():
    rng = np.random.default_rng(0)
    keys, values = rng.standard_normal((2, 3, 2, 4, 5)), rng.standard_normal((2, 3, 2, 4, 5))
    mask = np.array([[0, 1, 1, 1], [1, 1, 1, 1], [0, 0, 1, 1]], dtype="float32")
    cache = DecodeCache(keys, values, mask, np.array([3, 4, 2]))
    positions, fed_keys, fed_values, wide = cache.step_inputs()
    capacity = 4 + kv_cache.GROW
    assert positions.tolist() == [[3], [4], [2]]
    assert fed_keys.shape == (2, 3, 2, capacity, 5) and fed_keys.flags.c_contiguous
    assert np.array_equal(fed_keys[:, :, :, :4], keys) and not fed_keys[:, :, :, 4:].any()
    # the free columns are masked; the new token's column (the program appends it last) is 1
    assert wide.shape == (3, capacity + 1) and np.array_equal(wide[:, :4], mask)
    assert not wide[:, 4:capacity].any() and (wide[:, capacity] == 1).all()
    new_k, new_v = rng.standard_normal((2, 3, 2, 1, 5)), rng.standard_normal((2, 3, 2, 1, 5))
    cache.append(new_k, new_v)
    assert np.array_equal(cache.keys, np.concatenate([keys, new_k], axis=3))
    assert np.array_equal(cache.values, np.concatenate([values, new_v], axis=3))
    assert cache.mask[:, 4].tolist() == [1, 1, 1] and cache.lengths.tolist() == [4, 5, 3]
    assert cache.step_inputs()[1] is fed_keys and cache.copies == 1  # (the same buffer: nothing copied)
    # rows leave: copied once, and the leading columns no remaining row uses are gone
    cache.keep([0, 2])
    assert cache.copies == 2 and cache.step_inputs()[1] is not fed_keys
    assert np.array_equal(cache.keys, np.concatenate([keys, new_k], axis=3)[:, [0, 2], :, 1:])
    assert cache.mask.tolist() == [[1, 1, 1, 1], [0, 1, 1, 1]]
    # rows join, the narrower left-padded with masked columns
    other = DecodeCache(keys[:, :1, :, :2], values[:, :1, :, :2], np.ones((1, 2), "float32"), np.array([2]))
    cache.join(other)
    assert cache.rows == 3 and cache.mask[2].tolist() == [0, 0, 1, 1] and cache.lengths.tolist() == [4, 3, 2]
    assert np.array_equal(cache.keys[:, 2, :, 2:], keys[:, 0, :, :2]) and not cache.keys[:, 2, :, :2].any()
