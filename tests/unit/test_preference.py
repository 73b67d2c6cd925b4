"""Preference tuning (training/finetune/preference.py, training/finetune/dpo.py): the two data formats, bad rows
refused in one line naming the file and line, pairs encoded with the last answer learned alone, and the losses:
dpo's step-0 loss is ln 2 with every reward 0 when the reference is the model itself, and is not with a reference
from another checkpoint; simpo's margin and the SFT term as written."""
import json
import math

import numpy as np
import pytest

import core  # noqa: F401  (zlib before paddle)
import paddle  # noqa: E402
from paddlenlp.transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from core.config import load_config  # noqa: E402
from core.errors import ConfigError  # noqa: E402
from training.finetune import dpo, preference  # noqa: E402
from training.finetune import data as sft  # noqa: E402


def test_both_formats_read_to_one_shape():
    trl = preference.parse(json.dumps({"prompt": "问", "chosen": "好", "rejected": "坏"}), "f:1")
    conversational = preference.parse(json.dumps({
        "messages": [{"role": "system", "content": "系统"}, {"role": "user", "content": "问"}],
        "chosen": [{"role": "assistant", "content": "好"}], "rejected": [{"role": "assistant", "content": "坏"}]}),
        "f:2")
    paddlenlp = preference.parse(json.dumps({"src": ["一", "二"], "tgt": ["答一"], "response": ["坏", "好"],
                                             "sort": [0, 1]}), "f:3")
    assert (trl["prompt"], trl["chosen"], trl["rejected"]) == ([{"role": "user", "content": "问"}], "好", "坏")
    assert conversational["prompt"][0] == {"role": "system", "content": "系统"} and conversational["chosen"] == "好"
    assert paddlenlp["prompt"] == [{"role": "user", "content": "一"}, {"role": "assistant", "content": "答一"},
                                   {"role": "user", "content": "二"}]
    assert (paddlenlp["chosen"], paddlenlp["rejected"]) == ("好", "坏")  # (sort: the higher rank is chosen)


@pytest.mark.parametrize("row, message", [
    ({"prompt": "问", "chosen": "好"}, "f.jsonl:7: no 'rejected'"),
    ({"prompt": "问", "chosen": "好", "rejected": "好"}, "f.jsonl:7: chosen and rejected are the same answer"),
    ({"src": "问", "tgt": [], "response": ["a", "b"], "sort": [1, 1]}, "f.jsonl:7: sort ranks the two responses equal"),
    ({"src": "问", "tgt": [], "response": ["a"], "sort": [1]}, "f.jsonl:7: response must be two answers"),
    ({"prompt": [{"role": "assistant", "content": "x"}], "chosen": "a", "rejected": "b"},
     "f.jsonl:7: the conversation must end with a user message"),
    ({"text": "x"}, "f.jsonl:7: expected"),
])
def test_a_bad_row_is_refused_in_one_line_naming_file_and_line(row, message):
    with pytest.raises(ConfigError) as caught:
        preference.parse(json.dumps(row, ensure_ascii=False), "f.jsonl:7")
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)


def test_a_pair_over_the_context_is_refused_and_nothing_is_written(tmp_path, tiny_tokenizer):
    data = tmp_path / "pairs.jsonl"
    data.write_text(json.dumps({"prompt": "短", "chosen": "好", "rejected": "坏"}, ensure_ascii=False) + "\n"
                    + json.dumps({"prompt": "长" * 200, "chosen": "好", "rejected": "坏"}, ensure_ascii=False) + "\n",
                    encoding="utf-8")
    config = load_config(None, [f"finetune.data={data}", "finetune.method=dpo", "training.seq_length=32",
                                f"data.cache_dir={tmp_path / 'cache'}", "training.global_batch_size=1",
                                "parallel.micro_batch_size=1"])
    with pytest.raises(ConfigError, match=rf"^{data}:2: the prompt with its answers is longer than "
                                          r"training.seq_length=32"):
        sft.encoded_set(config, tiny_tokenizer, tmp_path / "run", encoding=preference.ENCODING)
    assert list((tmp_path / "cache" / "pref").iterdir()) == [next((tmp_path / "cache" / "pref").glob(".*.lock"))]


def test_pairs_learn_the_last_answer_alone(tmp_path, tiny_tokenizer):
    from core import chat
    from core.tokenizer import fast_tokenizer, load_tokenizer

    tokenizer, fast = load_tokenizer(tiny_tokenizer), fast_tokenizer(tiny_tokenizer)
    messages = [{"role": "user", "content": "一"}, {"role": "assistant", "content": "早上好"},
                {"role": "user", "content": "二"}, {"role": "assistant", "content": "正面"}]
    last, every = (sft.encode_all(chat.TEMPLATE, fast, tokenizer.pad_token_id, [messages], 48, last_only=flag)[0]
                   for flag in (True, False))
    learned = lambda row: tokenizer.convert_ids_to_tokens([int(t) for t in row[1] if t != sft.IGNORE])  # noqa: E731
    assert learned(every) == ["早", "上", "好", "[SEP]", "正", "面", "[SEP]"]
    assert learned(last) == ["正", "面", "[SEP]"] and (last[0] == every[0]).all()


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    """A character vocabulary with the chat template's markers and the test's characters."""
    from core import chat

    root = tmp_path_factory.mktemp("tok")
    characters = sorted(set("".join(chat.TEMPLATE["conversation"]) + chat.TEMPLATE.get("system", "")
                            + "短长好坏问一二早上面正负系统用户助手：\n<>/|"))
    (root / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *characters]) + "\n",
                                    encoding="utf-8")
    chat.write(root)
    return root


def _model(seed: int) -> LlamaForCausalLM:
    paddle.seed(seed)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64))
    model.eval()
    return model


def _batch(rows: int = 6, length: int = 16):
    """Pairs whose answers are the last 3 (chosen) / 5 (rejected) tokens: labels -100 elsewhere."""
    rng = np.random.default_rng(1)
    out = {}
    for side, answer in (("chosen", 3), ("rejected", 5)):
        ids = rng.integers(5, 64, size=(rows, length))
        labels = np.full_like(ids, -100)
        labels[:, length - 1 - answer:length - 1] = ids[:, length - answer:]
        out[f"{side}_input_ids"], out[f"{side}_labels"] = ids, labels
    return out


def _rows(batch) -> np.ndarray:
    return np.stack([batch["chosen_input_ids"], batch["chosen_labels"], batch["rejected_input_ids"],
                     batch["rejected_labels"]], axis=1)


def test_dpo_step_0_loss_is_ln2_and_a_reference_from_another_checkpoint_is_not():
    settings = load_config(None, ["finetune.data=reviews", "finetune.method=dpo"]).finetune
    model, other = _model(1), _model(2)
    batch = _batch()
    own = preference.reference_logps(_rows(batch), dpo.logps_function(model), batch=4)  # (4: a partial last batch)
    foreign = preference.reference_logps(_rows(batch), dpo.logps_function(other), batch=6)
    tensors = {k: paddle.to_tensor(v) for k, v in batch.items()}
    loss, metrics = dpo.pair_loss(settings, model, {**tensors, "reference": paddle.to_tensor(own)})
    assert float(loss) == pytest.approx(math.log(2), abs=1e-6)
    assert all(abs(float(metrics[k])) < 1e-6 for k in ("rewards/chosen", "rewards/rejected", "rewards/margins"))
    assert float(metrics["rewards/accuracies"]) == 0.0  # (no pair's chosen reward is above its rejected one yet)
    assert float(metrics["logps/chosen"]) == pytest.approx(own[:, 0].mean(), rel=1e-5)
    wrong, _ = dpo.pair_loss(settings, model, {**tensors, "reference": paddle.to_tensor(foreign)})
    assert abs(float(wrong) - math.log(2)) > 1e-3
    # the reference as its definition: the log-probability of each labelled token under the model, summed
    logits = model(input_ids=tensors["chosen_input_ids"])[0].numpy()
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    labels = batch["chosen_labels"]
    want = [sum(logp[r, t, labels[r, t]] for t in range(labels.shape[1]) if labels[r, t] != -100)
            for r in range(len(labels))]
    assert own[:, 0] == pytest.approx(np.array(want), rel=1e-5)


def test_simpo_and_the_sft_term_as_written():
    f = load_config(None, ["finetune.data=reviews", "finetune.method=simpo", "finetune.simpo_beta=2",
                           "finetune.simpo_gamma=0.5", "finetune.sft_weight=0.3"]).finetune
    chosen, rejected = paddle.to_tensor([-3.0, -6.0]), paddle.to_tensor([-10.0, -2.5])
    counts_c, counts_r = paddle.to_tensor([3.0, 3.0]), paddle.to_tensor([5.0, 5.0])
    loss, metrics = dpo.objective(f, chosen, rejected, counts_c, counts_r)
    rc, rr = 2 * np.array([-1.0, -2.0]), 2 * np.array([-2.0, -0.5])
    want = np.mean(np.log1p(np.exp(-(rc - rr - 0.5)))) + 0.3 * np.mean([1.0, 2.0])
    assert float(loss) == pytest.approx(want, rel=1e-6)
    assert float(metrics["rewards/accuracies"]) == 0.5 and float(metrics["rewards/margins"]) == pytest.approx(
        np.mean(rc - rr))


def test_preference_settings_are_checked_before_anything_starts():
    with pytest.raises(ConfigError, match="finetune.weights=lora is for dpo / simpo"):
        load_config(None, ["finetune.data=reviews", "finetune.method=full", "finetune.weights=lora"])
    with pytest.raises(ConfigError, match="finetune.method=dpo: preference tuning runs data and tensor parallel"):
        load_config(None, ["finetune.data=reviews", "finetune.method=dpo", "parallel.pipeline=2",
                           "training.compile=false"])
    with pytest.raises(ConfigError, match="finetune.beta: must be > 0"):
        load_config(None, ["finetune.data=reviews", "finetune.method=dpo", "finetune.beta=0"])
    assert load_config(None, ["finetune.data=reviews", "finetune.method=dpo", "finetune.weights=lora"]).finetune.lora
