"""model/llama.py: the CPU replacements compute what PaddleNLP's Llama code computes."""
import numpy as np
import pytest

import core  # noqa: F401  (zlib before paddle)
import paddle  # noqa: E402
import paddlenlp.transformers.llama.modeling as llama  # noqa: E402

from model import llama as model  # noqa: E402
from core.workarounds import cpu_runtime  # noqa: E402


@pytest.fixture
def originals():
    model.restore_cpu_ops()
    saved = llama.LlamaRMSNorm.forward, llama.apply_rotary_pos_emb, llama.LlamaPretrainingCriterion.forward
    yield saved
    model.restore_cpu_ops()


def _grad_of(fn, *inputs, seed=0):
    """fn's outputs and the gradients of a fixed random projection of them w.r.t. every input."""
    leaves = [paddle.to_tensor(x, stop_gradient=False) for x in inputs]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    rng = np.random.RandomState(seed)
    total = sum((o * paddle.to_tensor(np.asarray(rng.randn(*o.shape), dtype="float32"))).sum() for o in outs)
    total.backward()
    return [o.numpy() for o in outs], [leaf.grad.numpy() for leaf in leaves]


@pytest.mark.parametrize("kv_heads,with_positions", [(4, True), (2, True), (4, False)])
def test_rotary_is_bitwise_paddlenlps(originals, kv_heads, with_positions):
    rng = np.random.RandomState(1)
    q = rng.randn(3, 7, 4, 16).astype("float32")
    k = rng.randn(3, 7, kv_heads, 16).astype("float32")
    rotary = llama.LlamaRotaryEmbedding(16, max_position_embeddings=32)
    cos, sin = rotary(paddle.to_tensor(q), seq_len=7)
    positions = paddle.to_tensor(np.tile(np.arange(7), (3, 1))[:, ::-1].copy()) if with_positions else None
    expected = _grad_of(lambda a, b: originals[1](a, b, cos, sin, positions), q, k)
    got = _grad_of(lambda a, b: model._apply_rotary_pos_emb(a, b, cos, sin, positions), q, k)
    for e, g in zip(expected[0] + expected[1], got[0] + got[1]):
        assert e.shape == g.shape and np.array_equal(e, g)


def test_loss_is_bitwise_paddlenlps_and_skips_ignored_labels(originals):
    config = llama.LlamaConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2)
    criterion = llama.LlamaPretrainingCriterion(config)
    rng = np.random.RandomState(2)
    logits = rng.randn(2, 9, 50).astype("float32")
    labels = rng.randint(0, 50, (2, 9))
    labels[0, :4] = -100  # ignore_index: not in the mean
    label_tensor = paddle.to_tensor(labels)
    expected = _grad_of(lambda x: originals[2](criterion, x, label_tensor), logits)
    got = _grad_of(lambda x: model._criterion_forward(criterion, x, label_tensor), logits)
    assert np.array_equal(expected[0][0], got[0][0]) and np.array_equal(expected[1][0], got[1][0])
    assert np.abs(expected[1][0][0, :4]).max() == 0  # ignored positions get no gradient


def test_norm_uses_an_exact_square(originals):
    config = llama.LlamaConfig(hidden_size=64, rms_norm_eps=1e-6)
    norm = llama.LlamaRMSNorm(config)
    norm.weight.set_value(paddle.to_tensor(np.random.RandomState(3).randn(64).astype("float32")))
    x = np.random.RandomState(4).randn(5, 6, 64).astype("float32")
    expected = _grad_of(lambda a: originals[0](norm, a), x)
    got = _grad_of(lambda a: model._rms_norm_forward(norm, a), x)
    # pow(x, 2) is 1 ulp off on some elements, square is not: the norm agrees to float32 rounding
    np.testing.assert_allclose(got[0][0], expected[0][0], rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(got[1][0], expected[1][0], rtol=2e-5, atol=1e-6)
    squared = paddle.square(paddle.to_tensor(x)).numpy()
    assert np.array_equal(squared, (x.astype("float64") ** 2).astype("float32"))


def test_a_model_trains_the_same_with_and_without(originals):
    def three_steps():
        paddle.seed(3)
        config = llama.LlamaConfig(vocab_size=120, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   tie_word_embeddings=False)
        model = llama.LlamaForCausalLM(config)
        optimizer = paddle.optimizer.AdamW(1e-2, parameters=model.parameters())
        ids = paddle.to_tensor(np.random.RandomState(0).randint(1, 120, (4, 13)))
        losses = []
        for _ in range(3):
            loss = model(input_ids=ids[:, :-1], labels=ids[:, 1:], return_dict=False)[0]
            loss.backward()
            optimizer.step()
            optimizer.clear_grad()
            losses.append(float(loss))
        return losses, [p.numpy() for p in model.parameters()]

    before = three_steps()
    assert model.apply_cpu_ops() and llama.apply_rotary_pos_emb is model._apply_rotary_pos_emb
    after = three_steps()
    np.testing.assert_allclose(after[0], before[0], rtol=1e-6)
    for a, b in zip(after[1], before[1]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    model.restore_cpu_ops()
    assert (llama.LlamaRMSNorm.forward, llama.apply_rotary_pos_emb,
            llama.LlamaPretrainingCriterion.forward) == originals


def test_the_off_switch_leaves_paddlenlp_alone(originals, monkeypatch):
    monkeypatch.setenv(cpu_runtime.CPU_LLAMA_OPS_ENV, "off")
    assert model.apply_cpu_ops() is False
    assert llama.apply_rotary_pos_emb is originals[1] and llama.LlamaRMSNorm.forward is originals[0]
