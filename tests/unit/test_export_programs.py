"""export/programs.py's cache programs on a small random model with grouped-query attention (the trained
fixtures have as many key/value heads as query heads): prefill + decode step by step equal the dynamic model, and
the decode program returns only the new token's keys and values (serving/engine/runtime.py appends them)."""
import numpy as np

import core  # noqa: F401  (zlib before paddle)
import paddle  # noqa: E402
from paddlenlp.transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from core import exportdir  # noqa: E402
from export import gates, programs  # noqa: E402
from serving.engine import runtime  # noqa: E402


def exported_gqa_model(export_dir, seed: int):
    """A small random Llama with grouped-query attention, its cache programs saved in `export_dir`."""
    paddle.seed(seed)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config)
    model.eval()
    programs.save_programs(model, export_dir)
    return model, config


def test_cache_programs_with_grouped_query_attention_match_the_dynamic_model(tmp_path):
    model, config = exported_gqa_model(tmp_path, 3)

    decode = runtime.create_predictor(tmp_path, prefix=exportdir.DECODE_PREFIX)
    assert decode.get_input_names() == ["input_ids", "position_ids", "key_mask", "past_keys_0", "past_keys_1",
                                        "past_values_0", "past_values_1"]
    prefill, step = runtime.cache_session(tmp_path)
    ids, positions, mask = np.array([[5, 6, 7]]), np.array([[0, 1, 2]]), np.ones((1, 3), "float32")
    _, keys, values = prefill(ids, positions, mask)
    assert keys.shape == values.shape == (2, 1, 2, 3, 8)  # [layers, batch, key/value heads, positions, head dim]
    _, grown, _ = step(np.array([[9]]), np.array([[3]]), np.ones((1, 4), "float32"), keys, values)
    assert grown.shape == (2, 1, 2, 4, 8) and np.array_equal(grown[:, :, :, :3], keys)

    # two rows, one left-padded, 12 decode steps each checked against the dynamic model's logits
    error = gates.cache_parity_error(model, prefill, step, config.vocab_size, seq_length=24)
    assert error < 1e-4, error


def test_decode_steps_across_cache_growth_equal_the_dynamic_model(tmp_path, monkeypatch):
    """The decode session's caches grow in buffers (runtime._GrowingCache); with room for 3 columns at a time, 12
    steps cross four growths and still equal the dynamic model."""
    monkeypatch.setattr(runtime._GrowingCache, "GROW", 3)
    model, config = exported_gqa_model(tmp_path, 4)
    prefill, step = runtime.cache_session(tmp_path)
    assert gates.cache_parity_error(model, prefill, step, config.vocab_size, seq_length=24) < 1e-4


def test_growing_cache_writes_one_column_a_step_and_copies_only_arrays_it_did_not_return():
    cache = runtime._GrowingCache()
    rng = np.random.default_rng(0)
    keys, values = rng.standard_normal((2, 3, 2, 4, 5)), rng.standard_normal((2, 3, 2, 4, 5))
    mask = np.array([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 1, 1, 1]], dtype="float32")
    fed_keys, fed_values, wide = cache.hold(keys, values, mask)
    capacity = 4 + cache.GROW
    assert fed_keys.shape == (2, 3, 2, capacity, 5) and fed_keys.flags.c_contiguous
    assert np.array_equal(fed_keys[:, :, :, :4], keys) and not fed_keys[:, :, :, 4:].any()
    # the free columns are masked; the new token's column (the program appends it last) keeps the caller's mask
    assert wide.shape == (3, capacity + 1) and np.array_equal(wide[:, :4], mask[:, :4])
    assert not wide[:, 4:capacity].any() and np.array_equal(wide[:, capacity], mask[:, 4])
    new_k, new_v = rng.standard_normal((2, 3, 2, 1, 5)), rng.standard_normal((2, 3, 2, 1, 5))
    grown_keys, grown_values = cache.append(new_k, new_v)
    assert np.array_equal(grown_keys, np.concatenate([keys, new_k], axis=3))
    assert np.array_equal(grown_values, np.concatenate([values, new_v], axis=3))
    # passed back as returned: the same buffer, nothing copied
    again, _, _ = cache.hold(grown_keys, grown_values, np.ones((3, 6), "float32"))
    assert again is fed_keys
    # rows dropped by the scheduler (a new array): copied into a new buffer
    kept_keys, kept_values = grown_keys[:, [0, 2]], grown_values[:, [0, 2]]
    fresh, _, _ = cache.hold(kept_keys, kept_values, np.ones((2, 6), "float32"))
    assert fresh is not fed_keys and np.array_equal(fresh[:, :, :, :5], kept_keys)
    # columns trimmed at the front (a view that does not start at the buffer's start): copied too
    cache.append(new_k[:, :2], new_v[:, :2])
    trimmed_keys, trimmed_values = cache.keys[:, :, :, 1:cache.used], cache.values[:, :, :, 1:cache.used]
    moved, _, _ = cache.hold(trimmed_keys, trimmed_values, np.ones((2, 6), "float32"))
    assert moved is not fresh and np.array_equal(moved[:, :, :, :5], trimmed_keys)
