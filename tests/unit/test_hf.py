"""The Hugging Face Llama export (export/hf.py): HF's names and layouts, and HF's Llama arithmetic (written out in
numpy here: RMSNorm, rotate-half rotary, causal attention, SwiGLU, untied head) over the converted weights gives the
Paddle model's logits. The tokenizer.json gives this project's ids and decodes as it does."""
import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from core import chat
from core.tokenizer import SPECIAL_TOKENS, decode, load_tokenizer, write_tokenizer
from export import hf
from hf_oracle import hf_logits as hf_llama_logits


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    import paddle
    from paddlenlp.transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("hf")
    write_tokenizer(SPECIAL_TOKENS + list("用户助手：评论好差正面负这") + ["abc", "##de"], root / "tokenizer")
    chat.write(root / "tokenizer")
    paddle.seed(3)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                         bos_token_id=2, eos_token_id=3, pad_token_id=0, tie_word_embeddings=False))
    model.eval()
    return model, hf.write(model, root / "tokenizer", root), root


def test_hf_names_layouts_and_arithmetic_give_the_paddle_logits(written):
    import paddle

    model, out, _ = written
    state, config = load_file(str(out / "model.safetensors")), json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and not config["tie_word_embeddings"] and config["eos_token_id"] == 3
    assert state["model.layers.0.mlp.gate_proj.weight"].shape == (40, 32)  # torch's [out, in]
    assert state["model.layers.1.mlp.down_proj.weight"].shape == (32, 40)
    assert state["lm_head.weight"].shape == (128, 32) and state["model.embed_tokens.weight"].shape == (128, 32)
    paddle_state = {k: v.numpy() for k, v in model.state_dict().items()}
    assert np.array_equal(state["model.layers.0.self_attn.q_proj.weight"],
                          paddle_state["llama.layers.0.self_attn.q_proj.weight"].T)
    assert len(state) == len(paddle_state)
    ids = np.array([5, 9, 17, 33, 2, 70, 101, 8, 64, 12])
    with paddle.no_grad():
        expected = model(paddle.to_tensor(ids[None]))[0].numpy()[0]
    assert np.abs(hf_llama_logits(state, config, ids) - expected).max() < 1e-4


def test_hf_tokenizer_gives_this_projects_ids_and_text(written):
    from tokenizers import Tokenizer

    _, out, root = written
    tok, ours = Tokenizer.from_file(str(out / "tokenizer.json")), load_tokenizer(root / "tokenizer")
    for text in ("评论：好", "用户：这 abcde 正面[SEP]", "差？"):
        ids = tok.encode(text).ids
        assert ids == ours.encode(text, add_special_tokens=False)["input_ids"], text
        assert tok.decode(ids) == decode(ours, ids)
    settings = json.loads((out / "tokenizer_config.json").read_text())
    assert settings["eos_token"] == "[SEP]" and "chat_template" in settings


def test_the_hf_chat_template_renders_the_models_template(written):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    _, out, root = written
    template = json.loads((out / "tokenizer_config.json").read_text())["chat_template"]
    messages = [{"role": "system", "content": "甲"}, {"role": "user", "content": "一"},
                {"role": "assistant", "content": "二"}, {"role": "user", "content": "三"}]
    rendered = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(template).render(
        messages=messages, add_generation_prompt=True)
    assert rendered == chat.render_messages(chat.read(root / "tokenizer"), messages)
