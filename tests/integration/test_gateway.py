"""The API gateway (make gateway: real nginx) in front of two real replicas of the session's export: keys, per-key
requests per minute, token budgets, revocation without restart, usage per consumer equal to the answers' `usage`,
a consumer header clients cannot forge, failover when a replica is killed, a weighted split."""
import json
import re
import signal
import threading
import time
from collections import Counter

import pytest
import requests

from helpers import cli, serving_ports, wait_until
from core.processes import descendants, free_port, group_alive, signal_pids

pytestmark = pytest.mark.slow
MODEL = "test-model"


def start_replica(exported, root, name):
    overrides = [*exported["overrides"], *serving_ports(), "serving.workers=1", f"training.runs_dir={root / name}"]
    proc = cli(["serve", "--config", str(exported["config"]), "--model", str(exported["export_dir"]), *overrides],
               exported["uri"])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    state = json.loads((root / name / "serving" / "server.json").read_text())
    return {"name": name, "overrides": overrides, "state": state, "url": state["api_url"]}


def stop_replica(exported, replica):
    cli(["stop", "--config", str(exported["config"]), *replica["overrides"]], exported["uri"])


@pytest.fixture(scope="module")
def gateway(exported, tmp_path_factory):
    root = tmp_path_factory.mktemp("gateway")
    replicas = [start_replica(exported, root, name) for name in ("a", "b")]
    settings = [f"gateway.port={free_port()}", f"gateway.state_dir={root / 'gw'}", f"gateway.keys_dir={root / 'keys'}",
                f"gateway.backends=[{replicas[0]['url']}, {replicas[1]['url']}]", "gateway.fail_timeout_s=2",
                "gateway.paddle_backends=[" + ", ".join(f"http://127.0.0.1:{r['state']['http_port']}"
                                                        for r in replicas) + "]"]
    proc = cli(["gateway", "--config", str(exported["config"]), *settings], exported["uri"])
    try:
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        url = re.search(r"^url: (\S+)$", proc.stdout, re.M).group(1)
        yield {**exported, "root": root, "replicas": replicas, "settings": settings, "url": url}
    finally:
        stopped = cli(["gateway-stop", "--config", str(exported["config"]), *settings], exported["uri"])
        for replica in replicas:
            stop_replica(exported, replica)
    assert "gateway stopped" in stopped.stdout


def new_key(gw, name, rpm, tpm=0) -> str:
    proc = cli(["gateway-key", "--config", str(gw["config"]), "--name", name, "--rpm", str(rpm), "--tpm", str(tpm),
                *gw["settings"]], gw["uri"])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    key = proc.stdout.strip().splitlines()[-1].removeprefix("key: ")
    assert key.startswith("sk-") and proc.stdout.count(key) == 1  # (printed once, as the last line)
    return key


def ask(gw, key, headers=None, **body):
    return requests.post(f"{gw['url']}/v1/completions", timeout=60, headers={
        "Authorization": f"Bearer {key}", **(headers or {})}, json={"model": MODEL, "prompt": "快递", "max_tokens": 4,
                                                                   "temperature": 0, **body})


def test_the_openai_client_works_through_the_gateway_with_a_key(gateway):
    import openai

    key = new_key(gateway, "app", 1000)
    client = openai.OpenAI(base_url=f"{gateway['url']}/v1", api_key=key, max_retries=0)
    direct = openai.OpenAI(base_url=f"{gateway['replicas'][0]['url']}/v1", api_key="unused", max_retries=0)
    asked = dict(model=MODEL, prompt="这本书", max_tokens=6, temperature=0)
    answer = client.completions.create(**asked)
    assert answer.choices[0].text == direct.completions.create(**asked).choices[0].text and answer.usage.total_tokens
    streamed = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **asked))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == answer.choices[0].text
    assert streamed[-1].usage.completion_tokens == answer.usage.completion_tokens
    assert [m.id for m in client.models.list().data] == [MODEL]
    with pytest.raises(openai.AuthenticationError) as refused:
        openai.OpenAI(base_url=f"{gateway['url']}/v1", api_key="sk-unknown", max_retries=0).completions.create(**asked)
    assert refused.value.status_code == 401 and refused.value.body["code"] == "invalid_api_key"
    reply = requests.post(f"{gateway['url']}/v1/completions", json=asked, timeout=10)  # (no key at all)
    assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key"
    too_big = ask(gateway, key, prompt="长" * 20000)
    assert too_big.status_code == 413 and "request body" in too_big.json()["error"]["message"]
    # the key is nowhere in the gateway's state (configuration, logs): only in the keys directory, owner-only
    for path in (gateway["root"] / "gw").rglob("*"):
        assert not path.is_file() or key not in path.read_text(errors="replace"), path
    assert oct((gateway["root"] / "keys" / "keys.json").stat().st_mode & 0o777) == "0o600"


def test_langchain_works_through_the_gateway_with_a_key(gateway):
    """LangChain's OpenAI completion model, unchanged, streamed and not (its chat model: tests/integration/
    test_finetune.py, where a model with a chat template is served)."""
    from langchain_openai import OpenAI

    key = new_key(gateway, "langchain", 1000)
    direct = requests.post(f"{gateway['replicas'][0]['url']}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "这本书", "max_tokens": 6, "temperature": 0})
    llm = OpenAI(base_url=f"{gateway['url']}/v1", api_key=key, model=MODEL, max_tokens=6, temperature=0, max_retries=0)
    text = llm.invoke("这本书")
    assert text == direct.json()["choices"][0]["text"] and "".join(llm.stream("这本书")) == text
    with pytest.raises(Exception, match="401"):
        OpenAI(base_url=f"{gateway['url']}/v1", api_key="sk-unknown", model=MODEL, max_retries=0).invoke("这本书")


def test_no_listener_but_the_gateway_on_a_non_loopback_address(gateway):
    """`ss -ltnp`: every port of both replicas (Paddle Serving's HTTP and gRPC, the OpenAI routes, metrics) listens
    on loopback; the gateway is the one listener on every interface."""
    import subprocess

    listeners = {}  # pid -> [local address]
    for line in subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, check=True).stdout.splitlines():
        for pid in re.findall(r"pid=(\d+)", line):
            listeners.setdefault(int(pid), []).append(line.split()[3])
    for replica in gateway["replicas"]:
        state = replica["state"]
        group = [state["pid"], *descendants(state["pid"])]
        addresses = [a for pid in group for a in listeners.get(pid, [])]
        assert {int(a.rsplit(":", 1)[1]) for a in addresses} >= {
            state[k] for k in ("http_port", "rpc_port", "api_port", "metrics_port")}, (addresses, state)
        assert all(a.rsplit(":", 1)[0] in ("127.0.0.1", "[::1]", "[::ffff:127.0.0.1]") for a in addresses), addresses
    nginx = json.loads((gateway["root"] / "gw" / "gateway.json").read_text())["pid"]
    port = gateway["url"].rsplit(":", 1)[1]
    assert {a for pid in (nginx, *descendants(nginx)) for a in listeners.get(pid, [])} == {f"0.0.0.0:{port}"}


def test_per_key_requests_and_tokens_per_minute_and_revocation(gateway):
    key = new_key(gateway, "rpm5", 5)
    assert [ask(gateway, key).status_code for _ in range(5)] == [200] * 5
    limited = ask(gateway, key)
    assert limited.status_code == 429 and limited.headers["Retry-After"] == "12"  # (60 s / 5 requests)
    assert limited.json()["error"]["code"] == "rate_limited"

    # refused once the last minute's answers reach 10 tokens: each of the 2 replicas holds half the budget, so give
    # or take one request per replica
    budget = new_key(gateway, "tpm", 1000, tpm=10)
    spent = []
    for _ in range(10):
        reply = ask(gateway, budget)
        if reply.status_code != 200:
            break
        spent.append(reply.json()["usage"]["total_tokens"])
    assert reply.status_code == 429 and int(reply.headers["Retry-After"]) >= 1
    assert "over its tokens-per-minute budget" in reply.json()["error"]["message"]
    assert sum(spent) >= 10 and sum(spent[:-2]) < 10, spent

    revoked = new_key(gateway, "leaving", 10000)
    codes, stop = [], threading.Event()

    def traffic():
        while not stop.is_set():
            codes.append((time.monotonic(), ask(gateway, revoked).status_code))

    thread = threading.Thread(target=traffic)
    thread.start()
    time.sleep(1.0)
    proc = cli(["gateway-key", "--config", str(gateway["config"]), "--revoke", "leaving", *gateway["settings"]],
               gateway["uri"])
    revoked_at = time.monotonic()
    time.sleep(1.5)
    stop.set()
    thread.join(30)
    assert proc.returncode == 0 and "revoked leaving" in proc.stdout
    assert {c for _, c in codes} == {200, 401}  # (no request failed otherwise while nginx reloaded)
    assert all(c == 401 for t, c in codes if t > revoked_at + 1.0) and any(t > revoked_at + 1.0 for t, _ in codes)


def test_usage_per_consumer_equals_the_answers_usage_and_the_header_cannot_be_forged(gateway):
    keys = {name: new_key(gateway, name, 1000) for name in ("team-a", "team-b")}
    sums = {name: Counter() for name in keys}
    for i in range(6):
        for name, key in keys.items():
            # team-a claims to be team-b: nginx replaces the header, the tokens are team-a's
            reply = ask(gateway, key, headers={"X-Pipeline-Consumer": "team-b"} if name == "team-a" else None,
                        max_tokens=3 + i, prompt="人工智能"[:1 + i % 4])
            assert reply.status_code == 200
            sums[name].update(counts(reply.json()["usage"]))
            assert reply.headers["X-Model-Version"] == "1" and reply.headers["X-Model-Name"] == MODEL
        body = {"model": MODEL, "prompt": "好", "max_tokens": 5, "stream": True,
                "stream_options": {"include_usage": True}}
        events = requests.post(f"{gateway['url']}/v1/completions", stream=True, timeout=60,
                               headers={"Authorization": f"Bearer {keys['team-b']}"}, json=body)
        last = [json.loads(line[6:]) for line in events.iter_lines(decode_unicode=True)
                if line.startswith("data: {")][-1]
        sums["team-b"].update(counts(last["usage"]))
    rows = usage_rows(gateway)
    assert rows["team-a"] == [6, sums["team-a"]["prompt_tokens"], sums["team-a"]["completion_tokens"], 0]
    assert rows["team-b"] == [12, sums["team-b"]["prompt_tokens"], sums["team-b"]["completion_tokens"], 0]


def counts(usage: dict) -> dict[str, int]:
    """An answer's usage token counts (without prompt_tokens_details)."""
    return {k: v for k, v in usage.items() if isinstance(v, int)}


def usage_rows(gw) -> dict[str, list[int]]:
    """make gateway-usage: {consumer: [requests, prompt_tokens, completion_tokens, 429s]} over its models."""
    proc = cli(["gateway-usage", "--config", str(gw["config"]), *gw["settings"]], gw["uri"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows: dict[str, list[int]] = {}
    for line in proc.stdout.splitlines()[1:]:
        if line.startswith("("):  # ("no requests through the gateway yet")
            continue
        name, _model, *numbers = line.split()
        rows[name] = [a + int(b) for a, b in zip(rows.get(name, [0, 0, 0, 0]), numbers)]
    return rows


def test_a_replica_killed_under_load_loses_no_request_and_no_usage_and_comes_back(gateway):
    """8 clients, one of two replicas SIGKILLed: no request fails, and make gateway-usage equals the sum of the
    answers' `usage` exactly (the dead replica's share included), also after the gateway itself is restarted."""
    key, streamer = new_key(gateway, "load", 100000), new_key(gateway, "load-stream", 100000)
    victim = gateway["replicas"][0]
    used = Counter()
    load = Load(lambda session: ask(gateway, key, max_tokens=8), 8, lambda reply: used.update(counts(reply.json()["usage"])))
    time.sleep(2)
    stream = requests.post(f"{gateway['url']}/v1/completions", stream=True, timeout=30, headers={
        "Authorization": f"Bearer {streamer}"}, json={"model": MODEL, "prompt": "好", "max_tokens": 64, "stream": True})
    pid = victim["state"]["pid"]
    kill_replica(pid)
    started = time.monotonic()
    try:  # a stream under way ends (completed, or cut with an error), never hangs
        list(stream.iter_lines())
    except requests.RequestException:
        pass
    assert time.monotonic() - started < 30
    time.sleep(3)
    failures, answered = load.stop()
    assert not group_alive(pid) and failures == [] and answered[200] > 20, (failures, answered)
    expected = [answered[200], used["prompt_tokens"], used["completion_tokens"], 0]
    assert wait_until(lambda: usage_rows(gateway).get("load") == expected, 10), (usage_rows(gateway), expected)
    stopped = cli(["gateway-stop", "--config", str(gateway["config"]), *gateway["settings"]], gateway["uri"])
    restarted = cli(["gateway", "--config", str(gateway["config"]), *gateway["settings"]], gateway["uri"])
    assert "gateway stopped" in stopped.stdout and restarted.returncode == 0, restarted.stderr[-2000:]
    assert usage_rows(gateway)["load"] == expected
    # back: make serve again on the same ports; the gateway sends it requests again without a restart
    back = start_replica_again(gateway, victim)
    time.sleep(2.5)  # (gateway.fail_timeout_s)
    port = victim["url"].rsplit(":", 1)[1]
    log = gateway["root"] / "gw" / "access.log"
    before = len(log.read_text().splitlines())
    assert all(ask(gateway, key).status_code == 200 for _ in range(10))
    served = [json.loads(line)["upstream"] for line in log.read_text().splitlines()[before:]]
    assert any(u.endswith(f":{port}") for u in served), served
    gateway["replicas"][0] = back


class Load:
    """`clients` threads, each sending `send(session)` until `stop()`: the answers by status, the failures (an answer
    that is not 200, an exception), and `on_ok(reply)` for each 200 (under a lock)."""

    def __init__(self, send, clients: int, on_ok=None):
        self.send, self.on_ok = send, on_ok
        self.failures, self.answered, self.lock, self.stopped = [], Counter(), threading.Lock(), threading.Event()
        self.threads = [threading.Thread(target=self._client) for _ in range(clients)]
        for t in self.threads:
            t.start()

    def _client(self):
        session = requests.Session()
        while not self.stopped.is_set():
            try:
                reply = self.send(session)
                with self.lock:
                    self.answered[reply.status_code] += 1
                    if reply.status_code != 200:
                        self.failures.append(reply.status_code)
                    elif self.on_ok:
                        self.on_ok(reply)
            except requests.RequestException as exc:
                self.failures.append(repr(exc))

    def stop(self):
        self.stopped.set()
        for t in self.threads:
            t.join(60)
        return self.failures, self.answered


def kill_replica(pid: int) -> None:
    """The replica's machine gone: SIGKILL to its whole process group at once (killing the workers first and the
    server after let a busy server start a replacement worker in between, which outlived it: a CI failure)."""
    import os

    children = descendants(pid)
    os.killpg(os.getpgid(pid), signal.SIGKILL)
    signal_pids(children, signal.SIGKILL)  # (any child outside the group)
    assert wait_until(lambda: not group_alive(pid), 10), f"replica {pid} still alive after SIGKILL"


def start_replica_again(gw, replica):
    proc = cli(["serve", "--config", str(gw["config"]), "--model", str(gw["export_dir"]), *replica["overrides"]],
               gw["uri"])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    state = json.loads((gw["root"] / replica["name"] / "serving" / "server.json").read_text())
    return {**replica, "state": state}


def test_models_are_routed_by_name_and_alias_and_bodies_checked_at_the_gateway(gateway):
    """gateway.models: an alias routed to one pool always lands there (the replica accepts the name it was routed
    by), the registered name is split, an unrouted name is the gateway's 404, max_tokens over the limit and a body
    that is not JSON are the gateway's 400 (no replica sees them); Paddle Serving's HTTP route passes with a key."""
    a, b = (r["url"] for r in gateway["replicas"])
    root = gateway["root"]
    settings = [f"gateway.port={free_port()}", f"gateway.state_dir={root / 'routed'}", f"gateway.keys_dir={root / 'keys'}",
                f"gateway.backends={{champion: [{a}], challenger: [{b}]}}", "gateway.split={champion: 50, challenger: 50}",
                f"gateway.models={{{MODEL}: [champion, challenger], {MODEL}@challenger: [challenger]}}"]
    key = new_key(gateway, "routed", 100000)
    proc = cli(["gateway", "--config", str(gateway["config"]), *settings], gateway["uri"])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    try:
        url, auth = re.search(r"^url: (\S+)$", proc.stdout, re.M).group(1), {"Authorization": f"Bearer {key}"}

        def post(path="/v1/completions", **body):
            return requests.post(f"{url}{path}", headers=auth, timeout=30, json={
                "model": MODEL, "prompt": "好", "max_tokens": 2, **body})

        pools = Counter()
        for _ in range(20):
            alias, name = post(model=f"{MODEL}@challenger"), post()
            assert alias.status_code == 200 and alias.json()["model"] == f"{MODEL}@challenger", alias.text
            assert alias.headers["X-Gateway-Pool"] == "pool_challenger"
            pools[name.headers["X-Gateway-Pool"]] += 1
        assert set(pools) == {"pool_champion", "pool_challenger"}, pools
        log = root / "routed" / "access.log"
        unknown = post(model="other-model")
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
        assert f"{MODEL}@challenger" in unknown.json()["error"]["message"]
        big = post(max_tokens=10 ** 6)
        assert big.status_code == 400 and big.json()["error"]["param"] == "max_tokens", big.text
        assert "limit of" in big.json()["error"]["message"]
        broken = requests.post(f"{url}/v1/completions", headers=auth, data="{not json", timeout=10)
        assert broken.status_code == 400 and broken.json()["error"]["code"] == "bad_request"
        def refused():  # (nginx writes a request's access-log line after its answer is sent)
            return [entry["upstream"] for entry in map(json.loads, log.read_text().splitlines())
                    if entry["status"] in (400, 404)]
        assert wait_until(lambda: len(refused()) >= 3, 10), refused()
        assert refused() == ["", "", ""]
        listed = requests.get(f"{url}/v1/models", headers=auth, timeout=10).json()
        assert [m["id"] for m in listed["data"]] == [MODEL, f"{MODEL}@challenger"]
        # a client cannot route itself: its own X-Pipeline-Routed-Model is replaced by the body's routed name
        forged = requests.post(f"{url}/v1/completions", timeout=30, headers={**auth, "X-Pipeline-Routed-Model": "x"},
                               json={"model": "x", "prompt": "好", "max_tokens": 2})
        assert forged.status_code == 404
    finally:
        cli(["gateway-stop", "--config", str(gateway["config"]), *settings], gateway["uri"])
    # Paddle Serving's own HTTP route through the first gateway: a key is needed, the answer is the replica's
    fields = {"key": ["prompt", "max_new_tokens", "temperature"], "value": ["快递", "4", "0"]}
    paddle = f"{gateway['url']}/{gateway['replicas'][0]['state']['http_url'].split('/', 3)[3]}"
    assert requests.post(paddle, json=fields, timeout=30).status_code == 401
    through = requests.post(paddle, json=fields, timeout=30, headers={"Authorization": f"Bearer {key}"}).json()
    direct = requests.post(gateway["replicas"][1]["state"]["http_url"], json=fields, timeout=30).json()
    answer = {k: dict(zip(r["key"], r["value"])) for k, r in (("through", through), ("direct", direct))}
    assert through["err_no"] == 0 and answer["through"]["text"] == answer["direct"]["text"], answer
    assert answer["through"]["token_ids"] == answer["direct"]["token_ids"] and answer["direct"]["text"], answer


def test_a_weighted_split_between_pools_and_a_dead_canary_pool_fails_over(gateway):
    """gateway.split 90/10 between two pools (one replica each) over 1,000 requests: within 3 points. The
    challenger's only replica SIGKILLed under 6 clients: no request fails (the champion takes its share); served
    again, it gets its share back without touching the gateway."""
    a, b = (r["url"] for r in gateway["replicas"])
    settings = [f"gateway.port={free_port()}", f"gateway.state_dir={gateway['root'] / 'split'}",
                f"gateway.keys_dir={gateway['root'] / 'keys'}", "gateway.fail_timeout_s=2",
                f"gateway.backends={{champion: [{a}], challenger: [{b}/v1]}}",
                "gateway.split={champion: 90, challenger: 10}"]
    key = new_key(gateway, "split", 100000)  # (in the shared keys directory, before this gateway starts)
    proc = cli(["gateway", "--config", str(gateway["config"]), *settings], gateway["uri"])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    try:
        url = re.search(r"^url: (\S+)$", proc.stdout, re.M).group(1)
        session = requests.Session()
        pools = Counter()
        for _ in range(1000):
            reply = session.post(f"{url}/v1/completions", timeout=30, headers={"Authorization": f"Bearer {key}"},
                                 json={"model": MODEL, "prompt": "好", "max_tokens": 1})
            assert reply.status_code == 200
            pools[reply.headers["X-Gateway-Pool"]] += 1
        assert abs(pools["pool_champion"] / 1000 - 0.9) <= 0.03, pools
        canary_dies_and_comes_back(gateway, url, key, gateway["root"] / "split" / "access.log")
    finally:
        cli(["gateway-stop", "--config", str(gateway["config"]), *settings], gateway["uri"])


def canary_dies_and_comes_back(gw, url, key, log):
    victim = gw["replicas"][1]
    load = Load(lambda session: session.post(f"{url}/v1/completions", timeout=30, headers={
        "Authorization": f"Bearer {key}"}, json={"model": MODEL, "prompt": "好", "max_tokens": 4}), 6)
    time.sleep(1.5)
    pid = victim["state"]["pid"]
    kill_replica(pid)
    time.sleep(5)  # (longer than gateway.fail_timeout_s: the dead pool is tried again, and falls back again)
    failures, answered = load.stop()
    assert not group_alive(pid) and failures == [] and answered[200] > 30, (failures, answered)
    gw["replicas"][1] = start_replica_again(gw, victim)
    time.sleep(2.5)  # (gateway.fail_timeout_s)
    before = len(log.read_text().splitlines())
    session = requests.Session()
    assert all(session.post(f"{url}/v1/completions", timeout=30, headers={"Authorization": f"Bearer {key}"},
                            json={"model": MODEL, "prompt": "好", "max_tokens": 1}).status_code == 200
               for _ in range(200))
    port = victim["url"].rsplit(":", 1)[1]
    served = Counter(json.loads(line)["upstream"].endswith(f":{port}") for line in log.read_text().splitlines()[before:])
    assert 5 <= served[True] <= 40, served  # (its 10% share of 200, back)
