"""A real Paddle Serving server on free local ports: smoke checks, bad input, clean stop."""
import json
import subprocess
import sys

import pytest
import requests

from helpers import cli, env_for, free_port
from core import REPO_ROOT, tracking
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(exported):
    overrides = [*exported["overrides"], f"serving.http_port={free_port()}", f"serving.rpc_port={free_port()}",
                 "serving.max_prompt_chars=20", "serving.max_new_tokens_limit=12", "serving.default_max_new_tokens=8",
                 "serving.max_request_bytes=400"]
    base = ["--config", str(exported["config"])]
    proc = cli(["serve", *base, "--model", str(exported["export_dir"]), *overrides], exported["uri"])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    state_dir = exported["root"] / "runs" / "serving"
    state = json.loads((state_dir / "server.json").read_text())
    assert f"HTTP: {state['http_url']}" in proc.stdout and f"gRPC: {state['rpc_address']}" in proc.stdout
    yield {**exported, "state": state, "state_dir": state_dir, "cli": base + overrides}
    stopped = cli(["stop", *base, *overrides], exported["uri"])
    assert stopped.returncode == 0 and "stopped" in stopped.stdout
    from core.processes import group_alive, port_in_use

    assert not group_alive(state["pid"]), "server processes left behind"
    assert not port_in_use(state["http_port"]) and not port_in_use(state["rpc_port"])
    assert not (state_dir / "ProcessInfo.json").exists()


def test_serving_files_stay_in_the_state_directory(server):
    assert (server["state_dir"] / "PipelineServingLogs").is_dir() and (server["state_dir"] / "server.log").is_file()
    assert not (REPO_ROOT / "PipelineServingLogs").exists() and not (REPO_ROOT / "ProcessInfo.json").exists()


def test_smoke_checks_pass(server):
    from serving.smoke import run_smoke

    lines = []
    assert run_smoke(server["state"], tracking.client(server["uri"]), log=lines.append) == []
    assert sum("served greedy == the dynamic model's greedy (recorded at export)" in l for l in lines) == 3, lines


def test_smoke_fails_when_the_served_tokens_differ_from_the_recorded_ones(server, tmp_path):
    """Smoke reads the dynamic model's greedy tokens from the export directory: if they disagree with what the
    server answers, it fails (here: the same export with one recorded continuation altered)."""
    import shutil

    from core import exportdir
    from serving.smoke import run_smoke

    altered = tmp_path / "export"
    shutil.copytree(server["state"]["model_dir"], altered)
    references = exportdir.read_references(altered)
    prompt = exportdir.REFERENCE_PROMPTS[0]
    references[prompt] = [t + 1 for t in references[prompt]]
    exportdir.write_references(altered, references)
    failures = run_smoke({**server["state"], "model_dir": str(altered)}, None, log=lambda line: None)
    assert failures == [f"{prompt!r}: served greedy == the dynamic model's greedy (recorded at export)"]


def test_smoke_cli(server):
    proc = cli(["smoke", *server["cli"]], server["uri"])
    assert proc.returncode == 0 and "SMOKE PASS" in proc.stdout, proc.stdout[-3000:]
    # what `make all` ends with: the model's eval loss and greedy continuations of the reference prompts
    meta = json.loads((server["export_dir"] / "export.json").read_text())
    assert f"model test-model v1: checkpoint step 12 of run base, eval_loss {meta['metric_value']:.3f}" in proc.stdout
    for prompt in ("人工智能", "这本书", "快递很快，"):
        assert f"\n  {prompt} -> " in proc.stdout, prompt


def test_curl_shaped_request_returns_text_and_lineage(server):
    answer = requests.post(server["state"]["http_url"], data=json.dumps({"key": ["prompt"], "value": ["人工智能"]}),
                           timeout=30).json()
    fields = dict(zip(answer["key"], answer["value"]))
    assert answer["err_no"] == 0 and fields["model_name"] == "test-model" and fields["model_version"] == "1"
    assert len(json.loads(fields["token_ids"])) >= 1 and isinstance(fields["text"], str)


def test_sampling_is_reproducible_by_seed(server):
    from serving.client import GenerationClient

    client = GenerationClient(server["state"]["http_url"], server["state"]["rpc_address"])
    a = client.generate("这本书", max_new_tokens=6, temperature=1.0, top_k=20, seed=7)
    b = client.generate("这本书", max_new_tokens=6, temperature=1.0, top_k=20, seed=7)
    assert a.token_ids == b.token_ids
    # ... and seed and temperature are really used: other seeds give other samples, temperature 0 is greedy
    others = {tuple(client.generate("这本书", max_new_tokens=6, temperature=1.0, top_k=20, seed=s).token_ids)
              for s in (1, 2, 3)}
    assert others - {tuple(a.token_ids)}, "every seed gave the same sample"
    greedy = client.generate("这本书", max_new_tokens=6).token_ids
    assert client.generate("这本书", max_new_tokens=6, temperature=0.0, seed=99).token_ids == greedy


@pytest.mark.parametrize("fields, message", [
    ({"max_new_tokens": "3"}, "missing prompt"),
    ({"prompt": "   "}, "prompt is empty"),
    ({"prompt": "很" * 21}, "the limit is 20"),
    ({"prompt": "你好", "max_new_tokens": "0"}, "max_new_tokens must be in [1, 12]"),
    ({"prompt": "你好", "max_new_tokens": "13"}, "max_new_tokens must be in [1, 12]"),
    ({"prompt": "你好", "max_new_tokens": "2.5"}, "max_new_tokens must be an integer"),
    ({"prompt": "你好", "temperature": "hot"}, "temperature must be a number"),
    ({"prompt": "你好", "top_k": "-1"}, "top_k must be in"),
    ({"prompt": "你好", "beam_width": "4"}, "unknown parameter(s) beam_width"),
    ({"prompt": "你好", "seed": "x" * 500}, "the limit is 400"),
])
def test_bad_requests_get_an_error_and_the_server_stays_up(server, fields, message):
    from serving.client import GenerationClient

    client = GenerationClient(server["state"]["http_url"], server["state"]["rpc_address"])
    answer = client.raw_http(fields)
    assert answer["err_no"] != 0 and message in answer["err_msg"], answer
    assert client.generate("你好", max_new_tokens=2).token_ids


def test_concurrent_requests_are_batched_and_answer_as_alone(server):
    """Requests of mixed prompt lengths and settings, sent together, are generated in shared batches, and each gets
    exactly what it gets alone (greedy and seeded sampling)."""
    from concurrent.futures import ThreadPoolExecutor

    from serving.client import GenerationClient

    assert server["state"]["generation"] == "kv_cache" and server["state"]["op_processes"] >= 1
    requests_ = [("人工智能", {}), ("这本书很好看，我很喜欢", {"max_new_tokens": 3}), ("快", {"max_new_tokens": 12}),
                 ("价格便宜质量也好", {"temperature": 1.0, "top_k": 20, "seed": 5}),
                 ("快递很快", {"temperature": 0.8, "seed": 9})] * 4

    def call(item):
        prompt, kwargs = item
        return GenerationClient(server["state"]["http_url"], timeout=60).generate(prompt, **{
            "max_new_tokens": 6, **kwargs})

    alone = [call(item) for item in requests_[:5]]
    assert all(a.batch_size == 1 for a in alone)
    with ThreadPoolExecutor(10) as pool:
        together = list(pool.map(call, requests_))
    assert [r.token_ids for r in together] == [a.token_ids for a in alone] * 4
    assert max(r.batch_size for r in together) > 1, [r.batch_size for r in together]


def test_a_key_sent_twice_is_refused(server):
    body = {"key": ["prompt", "max_new_tokens", "prompt"], "value": ["你好", "2", "再见"]}
    answer = requests.post(server["state"]["http_url"], data=json.dumps(body), timeout=30).json()
    assert answer["err_no"] != 0 and "sent more than once: prompt" in answer["err_msg"], answer
    from serving.client import GenerationClient

    assert GenerationClient(server["state"]["http_url"]).generate("你好", max_new_tokens=1).token_ids


def test_malformed_json_is_a_400(server):
    response = requests.post(server["state"]["http_url"], data="{not json", timeout=30)
    assert response.status_code == 400
    from serving.client import GenerationClient

    assert GenerationClient(server["state"]["http_url"]).generate("你好", max_new_tokens=1).token_ids


def test_grpc_errors_raise(server):
    from serving.client import GenerationClient, ServingError

    client = GenerationClient(server["state"]["http_url"], server["state"]["rpc_address"])
    with pytest.raises(ServingError, match="prompt is empty"):
        client.generate_grpc("")
    assert client.generate_grpc("你好", max_new_tokens=2).token_ids


def test_client_cli(server):
    proc = subprocess.run([sys.executable, "-m", "serving.client", "人工智能", "--max-new-tokens", "3", "--url",
                           server["state"]["http_url"]], capture_output=True, text=True, cwd=REPO_ROOT,
                          env=env_for(server["uri"]), timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["model_name"] == "test-model"


def test_second_start_is_refused_while_running(server):
    proc = cli(["serve", *server["cli"][:2], "--model", str(server["export_dir"]), *server["cli"][2:]],
               server["uri"])
    assert proc.returncode == 2 and "already running" in proc.stderr


def test_full_sequence_path_and_thread_mode_serve_the_same_tokens(exported, tmp_path):
    """serving.generation=full (the graph re-run for every token) with thread workers answers the reference prompts
    with the dynamic model's greedy tokens, like the default kv_cache path with batching process workers."""
    from core import exportdir
    from core.config import load_config
    from serving import server
    from serving.client import GenerationClient

    config = load_config(exported["config"], [f"serving.http_port={free_port()}", f"serving.rpc_port={free_port()}",
                                              "serving.generation=full", "serving.op_mode=thread",
                                              "serving.batch_size=1",
                                              "serving.op_concurrency=2"])
    state = server.start(config, exported["export_dir"], tmp_path / "state")
    try:
        assert (state["generation"], state["op_processes"]) == ("full", 2)
        client = GenerationClient(state["http_url"], state["rpc_address"])
        references = exportdir.read_references(exported["export_dir"])
        for prompt, expected in references.items():
            assert client.generate(prompt, max_new_tokens=exportdir.REFERENCE_NEW_TOKENS).token_ids == expected
    finally:
        assert server.stop(tmp_path / "state")
