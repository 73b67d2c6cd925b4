"""Constrained decoding's cost and correctness (docs/benchmarks.md "Constrained decoding"):

- in process, at batch 64 over the export's vocabulary: the time to fill the 64 rows' masks (llguidance) and to
  choose with them, per step, against choosing the same rows free; and the scheduler with the masks filled during
  the decode step (serving/engine/scheduler.py overlap_masks) against in the choose step, rounds alternating;
- served, 32 closed-loop clients on the OpenAI completions route: `REQUESTS` requests each under one of the 10
  `SCHEMAS` (streamed and not, greedy and seeded), then the same requests without `response_format`, rounds
  alternating (constrained, free, constrained, ...), each free request asking for as many tokens as its constrained
  twin generated: generated tokens/s of each and the paired ratio per round, and
  how many constrained answers parse and validate against their schema (the `jsonschema` library).

    python -m bench.constrained --export <dir> [--rounds 2] [--requests 1000] [--out reports/bench-constrained]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import jsonschema
from bench.suite import out_dir
from core import exportdir
from serving import controller
from serving.engine.constraints import allowed_rows
from serving.engine.exported import ExportedModel
from serving.engine.generation import choose_rows
from serving.engine.scheduler import Job
from serving.engine.worker import build_scheduler
from serving.protocol import GenerationSettings
from serving.server.openai.structured import json_grammar

# Bounded where a free string, number or array would let a small model run to max_tokens (as with any engine)
SCHEMAS = [
    {"type": "object", "properties": {"label": {"enum": ["正面", "负面"]}}, "required": ["label"]},
    {"type": "object", "properties": {"score": {"type": "integer", "minimum": 0, "maximum": 100}},
     "required": ["score"]},
    {"type": "object", "properties": {"x": {"type": "number", "minimum": -5, "maximum": 5, "multipleOf": 0.25}},
     "required": ["x"]},  # (a number without multipleOf can take digits to max_tokens: measured, 6 of 60 did)
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "note": {"type": "string", "maxLength": 6}},
     "required": ["ok"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 3},
                                               "maxItems": 3}}, "required": ["tags"]},
    {"type": "object", "properties": {"city": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 4}, "zip": {"type": "integer", "minimum": 0, "maximum": 999}},
        "required": ["name"]}}, "required": ["city"]},
    {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                                            "minItems": 1, "maxItems": 4}}, "required": ["a"]},
    {"type": "object", "properties": {"kind": {"const": "天气"}, "v": {"anyOf": [{"type": "null"},
                                                                               {"type": "boolean"}]}},
     "required": ["kind", "v"]},
    {"type": "object", "properties": {"k": {"enum": ["晴", "雨", 1, None]}}, "required": ["k"]},
    {"type": "object", "properties": {"o": {"type": "string", "maxLength": 2},
                                      "p": {"type": "integer", "minimum": 0, "maximum": 9}}},
]
PROMPTS = ("评论：快递很快，质量不错\n", "评论：太差了，不推荐\n", "天气：", "你好，", "这本书")
CLIENTS, REQUESTS, MAX_TOKENS, BATCH = 32, 1000, 64, 64


def strict(schema):
    """As LangChain's strict json_schema: no properties but the declared ones, at every level."""
    if isinstance(schema, dict):
        schema = {k: strict(v) for k, v in schema.items()}
        if schema.get("type") == "object":
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        schema = [strict(v) for v in schema]
    return schema


def mask_cost(export_dir: Path, steps: int = 40) -> dict:
    """ms per step at batch 64: the masks filled, and choose_rows with them against the same rows free."""
    import serving  # noqa: F401  (zlib first)

    model = ExportedModel(export_dir)
    grammars, vocab = model.grammars, len(model.tokenizer)
    compile_ms = []
    for schema in map(strict, SCHEMAS):
        t0 = time.perf_counter()
        grammars.constraint(json_grammar(schema))
        compile_ms.append((time.perf_counter() - t0) * 1000)
    rng = np.random.default_rng(0)
    settings = [GenerationSettings(temperature=0.7 * (i % 2), seed=i) for i in range(BATCH)]
    rngs = [np.random.default_rng(i) for i in range(BATCH)]
    fill, masked, free = [], [], []
    rows = [grammars.constraint(json_grammar(strict(SCHEMAS[i % len(SCHEMAS)]))) for i in range(BATCH)]
    for _ in range(steps):
        logits = rng.normal(size=(BATCH, vocab)).astype("float32")
        t0 = time.perf_counter()
        allowed, failed = allowed_rows(rows, vocab)
        t1 = time.perf_counter()
        tokens = choose_rows(logits, settings, rngs, model.banned_ids, vocab, dict(enumerate(allowed)))
        t2 = time.perf_counter()
        choose_rows(logits, settings, rngs, model.banned_ids, vocab)
        t3 = time.perf_counter()
        fill.append(t1 - t0), masked.append(t2 - t1), free.append(t3 - t2)
        for r, token in enumerate(tokens):  # (a finished row starts its schema again: the batch stays at 64)
            if token == model.eos_id or failed.get(r) or not rows[r].matcher.consume_token(token):
                rows[r] = grammars.constraint(json_grammar(strict(SCHEMAS[r % len(SCHEMAS)])))
    ms = lambda xs: round(float(np.median(xs)) * 1000, 3)  # noqa: E731
    return {"batch": BATCH, "vocab": vocab, "fill_ms": ms(fill), "choose_masked_ms": ms(masked),
            "choose_free_ms": ms(free), "compile_ms_median": round(float(np.median(compile_ms)), 2)}


def overlap(export_dir: Path, rounds: int = 5, rows: int = BATCH) -> dict:
    """The scheduler in process, `rows` constrained sequences at a time, masks filled during the decode step
    (overlap_masks) against in the choose step: generated tokens/s of each, rounds alternating."""
    import serving  # noqa: F401  (zlib first)

    model = ExportedModel(export_dir)
    grammars = model.grammars
    rates: dict[str, list[float]] = {"on": [], "off": []}
    for round_index in range(rounds):
        for mode in (("on", "off") if round_index % 2 else ("off", "on")):
            scheduler = build_scheduler(model, 1, "kv_cache", max_batch_size=rows, overlap_masks=mode == "on")
            for i in range(rows * 2):
                grammar = json_grammar(strict(SCHEMAS[i % len(SCHEMAS)]))
                scheduler.add(Job(i, model.encode(PROMPTS[i % len(PROMPTS)]), GenerationSettings(
                    max_new_tokens=MAX_TOKENS, temperature=0.7 * (i % 2), seed=i, grammar=grammar),
                    constraint=grammars.constraint(grammar)))
            t0, tokens = time.perf_counter(), 0
            while not scheduler.idle:
                tokens += sum(len(o.job.new) for o in scheduler.step())
            rates[mode].append(tokens / (time.perf_counter() - t0))
    return {"rows": rows, **{f"{mode}_tokens_per_s": [round(r) for r in v] for mode, v in rates.items()},
            "ratio_median": round(float(np.median(np.array(rates["on"]) / np.array(rates["off"]))), 3)}


def served(export_dir: Path, out: Path, rounds: int, requests_per_phase: int) -> dict:
    from bench.serving_load import server_config

    state_dir = out / "serving-constrained"
    try:
        state = controller.start(server_config(), export_dir, state_dir, owner="bench")
        model = exportdir.read_meta(export_dir)["registered_model_name"]
        phases = []
        for round_index in range(rounds):  # (the free phase asks each request for its constrained twin's tokens)
            constrained = _phase(state["openai_base_url"], model, None, requests_per_phase)
            free = _phase(state["openai_base_url"], model, constrained.pop("lengths"), requests_per_phase)
            free.pop("lengths")
            phases += [{"round": round_index, "constrained": True, **constrained},
                       {"round": round_index, "constrained": False, **free}]
    finally:
        controller.stop(state_dir)
    ratios = [c["tokens_per_s"] / f["tokens_per_s"] for c, f in zip(phases[0::2], phases[1::2])]
    return {"clients": CLIENTS, "requests_per_phase": requests_per_phase, "phases": phases,
            "ratios": [round(r, 3) for r in ratios]}


def _phase(base_url: str, model: str, lengths: list[int] | None, count: int) -> dict:
    """`count` requests from CLIENTS threads, constrained (`lengths` None) or free with request k asking for
    lengths[k] tokens (its constrained twin's, so that both phases generate the same tokens in requests of the same
    sizes); tokens/s, each request's tokens and (constrained) how many answers validate."""
    constrained = lengths is None

    import openai

    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)

    def ask(k: int):
        schema = strict(SCHEMAS[k % len(SCHEMAS)])
        body = dict(model=model, prompt=PROMPTS[k % len(PROMPTS)], max_tokens=MAX_TOKENS if constrained else
                    lengths[k], temperature=0 if k % 3 == 0 else 1.0, seed=k)
        if constrained:
            body["extra_body"] = {"response_format": {"type": "json_schema", "json_schema": {
                "name": "a", "schema": schema, "strict": True}}}
        if k % 2:
            chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **body))
            text, tokens = "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage.completion_tokens
        else:
            answer = client.completions.create(**body)
            text, tokens = answer.choices[0].text, answer.usage.completion_tokens
        if not constrained:
            return tokens, True
        try:
            jsonschema.validate(json.loads(text), schema)
            return tokens, True
        except (ValueError, jsonschema.ValidationError):
            return tokens, False

    t0 = time.perf_counter()
    with ThreadPoolExecutor(CLIENTS) as pool:
        results = list(pool.map(ask, range(count)))
    elapsed = time.perf_counter() - t0
    tokens = sum(r[0] for r in results)
    return {"tokens_per_s": round(tokens / elapsed, 1), "tokens": tokens, "seconds": round(elapsed, 2),
            "valid": sum(r[1] for r in results), "requests": count, "lengths": [r[0] for r in results]}


def markdown(r: dict) -> list[str]:
    m, s, o = r["mask"], r["served"], r["overlap"]
    constrained = [p for p in s["phases"] if p["constrained"]]
    valid, total = sum(p["valid"] for p in constrained), sum(p["requests"] for p in constrained)
    return [f"- masks at batch {m['batch']} over {m['vocab']} tokens: filled in {m['fill_ms']} ms a step; choosing "
            f"with them {m['choose_masked_ms']} ms against {m['choose_free_ms']} ms free; a schema compiles in "
            f"{m['compile_ms_median']} ms (median of {len(SCHEMAS)})",
            f"- the scheduler in process, {o['rows']} constrained rows: masks filled during the decode step "
            f"{o['on_tokens_per_s']} against in the choose step {o['off_tokens_per_s']} tokens/s "
            f"(paired median {o['ratio_median']}x)",
            f"- {s['clients']} clients, {total} constrained requests over {len(SCHEMAS)} schemas: {valid} of {total} "
            f"parse and validate; tokens/s constrained / free per round: "
            + ", ".join(f"{c['tokens_per_s']:.0f} / {f['tokens_per_s']:.0f} ({ratio:.2f}x)" for c, f, ratio in
                        zip(s["phases"][0::2], s["phases"][1::2], s["ratios"]))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--export", required=True)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--requests", type=int, default=REQUESTS)
    p.add_argument("--out", default="reports/bench-constrained")
    args = p.parse_args()

    out = out_dir(args.out)
    result = {"mask": mask_cost(Path(args.export)), "overlap": overlap(Path(args.export)),
              "served": served(Path(args.export), out, args.rounds, args.requests)}
    (out / "constrained.json").write_text(json.dumps(result, indent=1))
    print("\n".join(markdown(result)))


if __name__ == "__main__":
    main()
