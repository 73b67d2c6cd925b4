"""export/programs.py's cache programs on a small random model with grouped-query attention (the trained
fixtures have as many key/value heads as query heads): prefill + decode step by step equal the dynamic model, and
the decode program returns only the new token's keys and values (serving/engine/runtime.py appends them)."""
import numpy as np

import core  # noqa: F401  (zlib before paddle)
import paddle  # noqa: E402
from paddlenlp.transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from core import exportdir  # noqa: E402
from export import gates, programs  # noqa: E402
from serving.engine import kv_cache, runtime  # noqa: E402
from serving.engine.kv_cache import DecodeCache  # noqa: E402


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
    cache = DecodeCache(keys, values, mask, np.array([3]))
    step(np.array([[9]]), cache)
    assert cache.keys.shape == (2, 1, 2, 4, 8) and np.array_equal(cache.keys[:, :, :, :3], keys)

    # two rows, one left-padded, 12 decode steps each checked against the dynamic model's logits
    error = gates.cache_parity_error(model, prefill, step, config.vocab_size, seq_length=24)
    assert error < 1e-4, error


def test_decode_steps_across_cache_growth_equal_the_dynamic_model(tmp_path, monkeypatch):
    """The decode cache grows in buffers (serving/engine/kv_cache.py); with room for 3 columns at a time, 12 steps
    cross four growths and still equal the dynamic model."""
    monkeypatch.setattr(kv_cache, "GROW", 3)
    model, config = exported_gqa_model(tmp_path, 4)
    prefill, step = runtime.cache_session(tmp_path)
    assert gates.cache_parity_error(model, prefill, step, config.vocab_size, seq_length=24) < 1e-4


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
