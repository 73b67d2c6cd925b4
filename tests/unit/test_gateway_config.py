"""The gateway's nginx.conf (serving/gateway/nginx.py render) follows the settings, and nginx itself accepts it."""
import re
import subprocess
from pathlib import Path

import pytest

from core.config import ConfigError, load_config
from serving.gateway import keys, nginx


def rendered(tmp_path, *overrides, consumers=None):
    config = load_config(None, [f"gateway.state_dir={tmp_path / 'gw'}", f"gateway.keys_dir={tmp_path / 'keys'}",
                                *overrides])
    path = nginx.write(config, consumers or {})
    return config, path.read_text(), (path.parent / nginx.LIMITS_FILE).read_text(), \
        (path.parent / "limits.d" / "requests.conf").read_text()


def test_the_rendered_configuration_follows_the_settings(tmp_path):
    config, conf, limits, requests = rendered(
        tmp_path, "gateway.port=18555", "gateway.host=127.0.0.2", "gateway.fail_timeout_s=7",
        "gateway.backends={champion: [http://127.0.0.1:1001, http://127.0.0.1:1002], "
        "challenger: [http://10.0.0.5:1003]}",
        "gateway.split={champion: 80, challenger: 20}", "serving.max_request_bytes=5000",
        consumers={"team-a": {"rpm": 6, "tpm": 1000}, "b.c": {"rpm": 100, "tpm": 0}})
    assert "listen 127.0.0.2:18555;" in conf and "client_max_body_size 5000;" in conf
    pools = dict(re.findall(r"upstream (pool_\w+) \{(.*?)\}", conf, re.S))
    assert re.findall(r"server (\S+) max_fails=1 fail_timeout=7s;", pools["pool_champion"]) == \
        ["127.0.0.1:1001", "127.0.0.1:1002"]
    assert re.findall(r"server (\S+) max_fails=1 fail_timeout=7s;", pools["pool_challenger"]) == ["10.0.0.5:1003"]
    # a pool whose replicas are all down: the other split pool's replicas take its share (backup servers)
    assert re.findall(r"server (\S+) .* backup;", pools["pool_challenger"]) == ["127.0.0.1:1001", "127.0.0.1:1002"]
    assert re.findall(r"server (\S+) .* backup;", pools["pool_champion"]) == ["10.0.0.5:1003"]
    assert re.search(r"split_clients \"\$\{request_id\}\" \$pool \{\s+80% pool_champion;\s+\* pool_challenger;", conf)
    assert "proxy_next_upstream_tries 3;" in conf and "non_idempotent" in conf  # (2 replicas + 1 backup)
    # the usage of each answer into the access log (the replica's header, or the stream's comment line via njs)
    assert '"usage":"$upstream_http_x_pipeline_usage$stream_usage"' in conf and "js_body_filter gw.usage" in conf
    assert "proxy_hide_header X-Pipeline-Usage;" in conf
    # the consumer header is nginx's: set from the key map, never the client's
    assert "proxy_set_header X-Pipeline-Consumer $consumer;" in conf and 'proxy_set_header Authorization "";' in conf
    assert f"include {tmp_path / 'keys'}/keys.map;" in conf
    # per consumer: RPM zone (burst RPM - 1), Retry-After 60 / RPM, TPM share = TPM x pool share / replicas
    assert sorted(requests.splitlines()) == sorted([
        f"limit_req zone=rpm_{'team-a'.encode().hex()} burst=5 nodelay;",
        f"limit_req zone=rpm_{'b.c'.encode().hex()} burst=99 nodelay;"])
    assert f"zone=rpm_{'team-a'.encode().hex()}:1m rate=6r/m;" in limits
    assert '"team-a" 10;' in limits and '"b.c" 1;' in limits  # (Retry-After)
    assert '"pool_champion team-a" 400;' in limits and '"pool_challenger team-a" 200;' in limits
    assert '"pool_champion b.c" 0;' in limits


def test_one_pool_by_default_and_bad_settings_refused(tmp_path):
    config, conf, _, requests = rendered(tmp_path, "serving.api_port=19182")
    assert re.search(r"upstream pool_default \{\s+server 127.0.0.1:19182 ", conf) and requests == ""
    assert "backup" not in conf and "only_" not in conf.split("map $route_pool $gateway_pool")[0]
    # the OpenAI clients' base-URL form is taken too
    _, conf, _, _ = rendered(tmp_path, "gateway.backends=[http://127.0.0.1:1001/v1, http://127.0.0.1:1002/v1/]")
    assert re.findall(r"server (\S+) max_fails", conf) == ["127.0.0.1:1001", "127.0.0.1:1002"]
    assert "listen 0.0.0.0:18190;" in conf
    for overrides, message in [
        (["gateway.split={a: 90, b: 10}"], "one weight for each pool"),
        (["gateway.backends={a: [http://x:1], b: [http://y:2]}", "gateway.split={a: 90, b: 20}"], "summing to 100"),
        (["gateway.backends={a: [http://x:1], b: [http://y:2]}"], "several pools need gateway.split"),
        (["gateway.backends=[localhost:1]"], "a list of base URLs"),
        (["gateway.port=18182"], "one of the server's own ports"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(None, overrides)


def test_models_route_to_their_pools_and_paddle_servings_route_has_its_backends(tmp_path):
    config, conf, limits, _ = rendered(
        tmp_path, "serving.max_new_tokens_limit=77",
        "gateway.backends={a: [http://127.0.0.1:1001], b: [http://127.0.0.1:1002], chat: [http://127.0.0.1:1003]}",
        "gateway.split={a: 90, b: 10}", "gateway.paddle_backends=[http://127.0.0.1:2001, http://127.0.0.1:2002]",
        "gateway.models={m: [a, b], m@b: [b], m-chat: [chat]}", consumers={"t": {"rpm": 5, "tpm": 1000}})
    routes = dict(re.findall(r'^\s+"([^"]+)" (\S+);$', re.search(r"map \$body_model \$route_pool \{(.*?)\}", conf,
                                                                  re.S).group(1), re.M))
    assert routes == {"m": "$pool", "m@b": "only_b", "m-chat": "pool_chat"}
    upstreams = dict(re.findall(r"upstream (\w+) \{(.*?)\}", conf, re.S))
    # m@b asked by name is b's alone (never another version's answer); the split's pool_b falls back on a
    assert "backup" not in upstreams["only_b"] and "127.0.0.1:1001" in upstreams["pool_b"]
    assert "backup" not in upstreams["pool_chat"] and "127.0.0.1:1003" not in upstreams["pool_a"]
    assert re.search(r"map \$body_model \$route_pool \{\s+default \"\";", conf)  # (other names: 404 in route.js)
    assert re.search(r"split_clients \"\$\{request_id\}\" \$pool \{\s+90% pool_a;\s+\* pool_b;", conf)
    assert "proxy_set_header X-Pipeline-Routed-Model $body_model;" in conf and "default 77;" in conf
    assert '"data": [{"id": "m", ' in conf and "js_content gw.check;" in conf
    assert re.findall(r"server (\S+) ", re.search(r"upstream paddle_http \{(.*?)\}", conf, re.S).group(1)) == \
        ["127.0.0.1:2001", "127.0.0.1:2002"]
    # the TPM share: 90% / 10% of the budget in the split's pools, all of it in a pool of its own
    assert '"pool_a t" 900;' in limits and '"pool_b t" 100;' in limits and '"pool_chat t" 1000;' in limits
    assert '"only_b t" 100;' in limits
    assert (tmp_path / "gw" / nginx.ROUTE_FILE).read_text() == (Path(nginx.__file__).parent / "route.js").read_text()
    # without models: every name to the split (or the one pool), no routed-name header, no model list
    _, plain, _, _ = rendered(tmp_path, "gateway.backends=[http://127.0.0.1:1001]")
    assert re.search(r"map \$body_model \$route_pool \{\s+default \$pool;\s+\}", plain)
    assert 'proxy_set_header X-Pipeline-Routed-Model "";' in plain and "location = /v1/models" not in plain
    assert "upstream paddle_http" not in plain and "no Paddle Serving HTTP backends" in plain
    for overrides, message in [
        (["gateway.backends={a: [http://x:1], b: [http://y:2]}", "gateway.models={m: [c]}"], "one pool of"),
        (["gateway.backends={a: [http://x:1], b: [http://y:2], c: [http://z:3]}", "gateway.split={a: 50, b: 50}",
          "gateway.models={m: [a, c]}"], "or the pools of gateway.split"),
        (["gateway.models={'m\"x': [default]}"], "model names are"),
        (["gateway.paddle_backends=[x:1]"], "gateway.paddle_backends: a list of base URLs"),
        (["gateway.backends={a: [http://x:1], b: [http://y:2], c: [http://z:3]}", "gateway.split={a: 50, b: 50}"],
         "pools outside the split need gateway.models"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(None, overrides)


def test_keys_are_kept_owner_only_and_named_safely(tmp_path):
    key = keys.create(tmp_path, "team-a", 5, 100)
    assert key.startswith("sk-") and len(key) > 40
    assert oct((tmp_path / keys.KEYS_FILE).stat().st_mode & 0o777) == "0o600"
    assert (tmp_path / keys.MAP_FILE).read_text() == f'"Bearer {key}" "team-a";\n'
    assert keys.create(tmp_path, "team-a", 5) != key and len(keys.read(tmp_path)) == 1  # (replaced)
    for name in ("", "a b", 'x";', "../etc"):
        with pytest.raises(ConfigError, match="a consumer name"):
            keys.create(tmp_path, name, 5)
    with pytest.raises(ConfigError, match="RPM must be >= 1"):
        keys.create(tmp_path, "c", 0)
    assert keys.revoke(tmp_path, "team-a") and not keys.revoke(tmp_path, "team-a")
    assert (tmp_path / keys.MAP_FILE).read_text() == ""


def test_nginx_accepts_the_rendered_configuration(tmp_path):
    _, _, _, _ = rendered(tmp_path, consumers={"a": {"rpm": 1, "tpm": 5}})
    checked = subprocess.run([nginx.binary(), "-t", "-c", str(tmp_path / "gw" / nginx.CONF_FILE), "-p",
                              str(tmp_path / "gw")], capture_output=True, text=True)
    assert checked.returncode == 0 and "syntax is ok" in checked.stderr, checked.stderr


@pytest.mark.parametrize("affinity, key", [("consumer", "$consumer"), ("session", "$affinity_session")])
def test_affinity_keeps_a_consumer_or_a_session_on_one_replica(tmp_path, affinity, key):
    """gateway.affinity: every pool's upstream hashes on the consumer or the X-Session-Id header (consistent: a dead
    replica's share moves, the others' stay); a session-less request gets a random key; nginx accepts it; refused
    with a split, whose failover needs backup replicas (which nginx's hash takes none of)."""
    two = "gateway.backends=[http://127.0.0.1:1001, http://127.0.0.1:1002]"
    _, conf, _, _ = rendered(tmp_path, two, f"gateway.affinity={affinity}")
    assert re.search(r"upstream pool_default \{\s+hash " + re.escape(key) + r" consistent;\s+server 127.0.0.1:1001 ",
                     conf), conf
    assert ('map $http_x_session_id $affinity_session {\n        "" $request_id;' in conf) == (affinity == "session")
    checked = subprocess.run([nginx.binary(), "-t", "-c", str(tmp_path / "gw" / nginx.CONF_FILE), "-p",
                              str(tmp_path / "gw")], capture_output=True, text=True)
    assert checked.returncode == 0 and "syntax is ok" in checked.stderr, checked.stderr
    assert "hash " not in rendered(tmp_path, two)[1]  # (by default: round robin)
    with pytest.raises(ConfigError, match="not with gateway.split"):
        load_config(None, ["gateway.backends={a: [http://x:1], b: [http://y:2]}", "gateway.split={a: 90, b: 10}",
                           f"gateway.affinity={affinity}"])


def test_the_kubernetes_gateway_is_the_rendered_configuration(tmp_path):
    """deploy/kubernetes/gateway.yaml is what serving/gateway/kubernetes.py renders from the default settings (no
    consumers: keys come from the operator's Secret), in front of serving.yaml's Service; its nginx.conf, laid out
    as the pod mounts it, passes nginx -t."""
    import yaml

    from core import REPO_ROOT
    from serving.gateway import kubernetes

    text = (REPO_ROOT / "deploy" / "kubernetes" / "gateway.yaml").read_text()
    assert text == kubernetes.manifest(load_config(None), {})
    configmap, deployment, service = yaml.safe_load_all(text)
    serving = list(yaml.safe_load_all((REPO_ROOT / "deploy" / "kubernetes" / "serving.yaml").read_text()))[1]
    api = {p["name"]: p["port"] for p in serving["spec"]["ports"]}["api"]
    conf = configmap["data"]["nginx.conf"]
    assert f"server {serving['metadata']['name']}:{api} max_fails=1" in conf and "listen 0.0.0.0:18190;" in conf
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["keys"]["secret"]["secretName"] == "paddle-gateway-keys"
    assert volumes["conf"]["configMap"]["name"] == configmap["metadata"]["name"]
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/gateway/health"
    # as the pod lays it out: the ConfigMap's files, the Secret's key map, the state directory
    (tmp_path / "conf").mkdir()
    (tmp_path / "keys").mkdir()
    (tmp_path / "state").mkdir()
    for name, body in configmap["data"].items():
        (tmp_path / "conf" / name).write_text(body.replace("/etc/gateway/", f"{tmp_path}/")
                                              .replace("/tmp/gateway", str(tmp_path / "state"))
                                              .replace("paddle-serve:", "127.0.0.1:"))  # (the cluster's DNS name)
    (tmp_path / "keys" / "keys.map").write_text('"Bearer sk-test" "someone";\n')
    checked = subprocess.run([nginx.binary(), "-t", "-c", str(tmp_path / "conf" / "nginx.conf"), "-p",
                              str(tmp_path / "state")], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
