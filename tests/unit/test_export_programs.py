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


def test_cache_programs_with_grouped_query_attention_match_the_dynamic_model(tmp_path):
    paddle.seed(3)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config)
    model.eval()
    programs.save_programs(model, tmp_path)

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
