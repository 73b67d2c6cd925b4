"""nginx as the gateway: its configuration rendered from the settings (`render`, pure: tested against the
settings), and the process (`start`, `reload`, `stop`), like `make object-store`: state (pid, nginx.conf, logs) in
gateway.state_dir, found again by `make gateway-stop`.

What the rendered configuration does, for every /v1/ request:
    key        `Authorization: Bearer <key>` -> the consumer (a map from keys.map); none or unknown: 401, OpenAI's
               error shape
    limits     one limit_req zone per consumer at its requests per minute (burst RPM - 1, nodelay: RPM requests in a
               minute pass, the next is 429 with Retry-After); the request body at most serving.max_request_bytes (413)
    consumer   X-Pipeline-Consumer and X-Pipeline-Consumer-Tpm set for the replica (a client's own copies are
               replaced); the client's key is not passed on
    body       route.js (njs) reads the JSON body: not a JSON object, or max_tokens over serving.max_new_tokens_limit:
               400 at the gateway, OpenAI's error shape
    pools      gateway.backends: one pool, or {pool: [urls]} split by gateway.split (split_clients on the request id);
               with gateway.models, the body's "model" picks the pool (or the split), an unrouted model is a 404, and
               X-Pipeline-Routed-Model tells the replica the name it was routed by (an alias it cannot know itself)
    paddle     Paddle Serving's HTTP route (POST /<service>/prediction) to gateway.paddle_backends, with the same
               keys, limits and consumer header
    failover   a replica that refuses, times out or answers 502/503 is skipped for gateway.fail_timeout_s and the
               request is sent to the next one (POSTs too: `non_idempotent`: a generation has no side effect); a
               split pool whose replicas are all down has its share taken by the other split pools (`fallbacks`);
               streams are passed through unbuffered, and one cut short by a dying replica ends (never hangs)
    log        one JSON line per request (consumer, status, pool, replica, the model version that answered and its
               `usage`: the replica's X-Pipeline-Usage header, or a stream's last comment line) in access.log: the
               usage table (usage.py), written by nginx as each answer ends, so no replica's crash loses it
"""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import time
import urllib.request
from pathlib import Path
import subprocess

from core.errors import ConfigError
from core.files import atomic_write
from core.processes import group_alive, log_tail, port_in_use, start_group, stop_recorded, wait_ready
from serving.protocol import CONSUMER_HEADER, ROUTED_MODEL_HEADER, TPM_HEADER, USAGE_HEADER
from core import REPO_ROOT
from core.processes import children_map
from serving.gateway import keys

STATE_FILE, CONF_FILE, LIMITS_FILE, ROUTE_FILE = "gateway.json", "nginx.conf", "limits.conf", "route.js"
INSTALL = ("nginx is not installed: `apt-get install nginx-light libnginx-mod-http-js` (Debian/Ubuntu; root), or "
           "nginx with its njs module from your package manager")
# njs, nginx's JavaScript module: Debian's libnginx-mod-http-js and the official nginx image put it here
JS_MODULE = "/usr/lib/nginx/modules/ngx_http_js_module.so"
NO_JS = ("nginx's njs module is not installed (it reads the request body: model routing, max_tokens): "
         "`apt-get install libnginx-mod-http-js` (Debian/Ubuntu; root)")


def binary() -> str:
    found = shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None)
    if not found:
        raise ConfigError(INSTALL)
    return found


def state_dir(config) -> Path:
    return Path(config.gateway.state_dir).expanduser().resolve() if config.gateway.state_dir else \
        (REPO_ROOT / config.training.runs_dir / "gateway").resolve()


def pools(config) -> dict[str, list[str]]:
    """{pool: [replica base URLs]}: gateway.backends, or this config's own `make serve` when it is empty."""
    g = config.gateway
    if isinstance(g.backends, dict):
        return {name: list(urls) for name, urls in g.backends.items()}
    return {"default": list(g.backends) or [f"http://127.0.0.1:{config.serving.api_port}"]}


def paddle_backends(config) -> list[str]:
    """Paddle Serving's HTTP base URLs: gateway.paddle_backends, or this config's own `make serve` when the
    backends are its own too."""
    g = config.gateway
    return list(g.paddle_backends) or ([] if g.backends else [f"http://127.0.0.1:{config.serving.http_port}"])


def _address(url: str) -> str:
    """host:port of a base URL (http://host:port, or the OpenAI clients' form http://host:port/v1)."""
    return url.split("://", 1)[1].rstrip("/").removesuffix("/v1")


CONF = """# Rendered by `make gateway` from the settings (serving/gateway/nginx.py); edits are overwritten.
daemon off;
load_module {js_module};
worker_processes 1;
pid {directory}/nginx.pid;
error_log {directory}/error.log warn;
events {{
    worker_connections 4096;
}}
http {{
    client_body_temp_path {directory}/body_temp;
    proxy_temp_path {directory}/proxy_temp;
    fastcgi_temp_path {directory}/fastcgi_temp;
    uwsgi_temp_path {directory}/uwsgi_temp;
    scgi_temp_path {directory}/scgi_temp;
    server_tokens off;
    default_type application/json;
    map_hash_bucket_size 256;  # (the key map's entries are "Bearer sk-<43 characters>")

    map $http_authorization $consumer {{
        default "";
        include {keys_directory}/keys.map;
    }}
    js_import gw from {directory}/{route_file};
    js_set $body_model gw.model;  # (read in @route and after: once route.js's check has the body in memory)
    map "" $max_new_tokens {{
        default {max_new_tokens};
    }}
    map "" $routed_models {{
        default "{routed_models}";
    }}
    map $body_model $route_pool {{
{routes}
    }}
    map $route_pool $gateway_pool {{  # (X-Gateway-Pool: the pool chosen, pool_<name> either way)
        default $route_pool;
        ~^only_(?<alone>.+)$ pool_$alone;
    }}
    js_var $stream_usage;  # (a stream's usage, read from its last comment line by route.js usage)
    include {directory}/{limits_file};
    log_format usage escape=json {log};
    access_log {directory}/access.log usage;

{upstreams}
{choose}

    server {{
        listen {host}:{port};
        client_max_body_size {max_bytes};
        client_body_buffer_size {max_bytes};
        limit_req_status 429;
        proxy_http_version 1.1;
        proxy_set_header Connection "";
        proxy_set_header Host $host;
        proxy_set_header Authorization "";
        proxy_set_header {consumer_header} $consumer;
        proxy_set_header {tpm_header} $consumer_tpm;
        proxy_set_header {routed_header} {routed_value};
        proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
        proxy_buffering off;
        proxy_connect_timeout 2s;
        proxy_read_timeout {read_timeout}s;
        proxy_next_upstream error timeout http_502 http_503 non_idempotent;
        proxy_next_upstream_tries {tries};
        add_header X-Gateway-Pool $gateway_pool always;

        location = /gateway/health {{
            return 200 '{{"gateway": "ok"}}';
        }}
{models_location}
        location /v1/ {{
            if ($consumer = "") {{
                return 401 '{unauthorized}';
            }}
            error_page 429 = @limited;
            error_page 413 = @too_large;
            include {directory}/limits.d/requests.conf;
            js_content gw.check;
        }}
        location @route {{
            proxy_pass http://$route_pool;
            proxy_hide_header {usage_header};
            js_body_filter gw.usage buffer_type=buffer;
        }}
        location ~ ^/[A-Za-z0-9_.-]+/prediction$ {{
            if ($consumer = "") {{
                return 401 '{unauthorized}';
            }}
            error_page 429 = @limited;
            error_page 413 = @too_large;
            include {directory}/limits.d/requests.conf;
            {paddle_pass}
        }}
        location @limited {{
            add_header Retry-After $retry_after always;
            return 429 '{limited}';
        }}
        location @too_large {{
            return 413 '{too_large}';
        }}
        location / {{
            return 404 '{{"error": {{"message": "no route $request_method $uri at the gateway", "type": "invalid_request_error", "param": null, "code": "not_found"}}}}';
        }}
    }}
}}
"""


def render(config, directory: Path, keys_directory: Path, consumers: dict) -> tuple[str, str]:
    """(nginx.conf, limits.conf): the whole configuration for `consumers` ({name: {"rpm", "tpm"}}, keys.json
    without the keys), state in `directory`, the key map in `keys_directory`."""
    g, s = config.gateway, config.serving
    by_pool = pools(config)
    limits, request_limits = _limits(config, consumers)
    (directory / "limits.d").mkdir(parents=True, exist_ok=True)
    atomic_write(directory / "limits.d" / "requests.conf", request_limits)
    upstreams, choose = _pools(config)
    backups = fallbacks(config)
    tries = max([len(urls) + len(backups.get(p, [])) for p, urls in by_pool.items()] + [len(paddle_backends(config))])
    unauthorized = json.dumps({"error": {"message": "missing or unknown API key: send `Authorization: Bearer <key>` "
                                         "(make gateway-key)", "type": "invalid_request_error", "param": None,
                                         "code": "invalid_api_key"}})
    limited = json.dumps({"error": {"message": "too many requests for this key (its requests per minute)",
                                    "type": "rate_limit_error", "param": None, "code": "rate_limited"}})
    too_large = json.dumps({"error": {"message": f"the request body is over {s.max_request_bytes} bytes",
                                      "type": "invalid_request_error", "param": None, "code": "bad_request"}})
    log = ("'{\"time\":\"$time_iso8601\",\"consumer\":\"$consumer\",\"method\":\"$request_method\",\"uri\":\"$uri\","
           "\"status\":$status,\"pool\":\"$route_pool\",\"upstream\":\"$upstream_addr\","
           "\"upstream_status\":\"$upstream_status\",\"request_time\":$request_time,"
           "\"model\":\"$upstream_http_x_model_name\",\"version\":\"$upstream_http_x_model_version\","
           "\"usage\":\"$upstream_http_x_pipeline_usage$stream_usage\"}'")
    no_paddle = json.dumps({"error": {"message": "no Paddle Serving HTTP backends at this gateway "
                                      "(gateway.paddle_backends)", "type": "invalid_request_error", "param": None,
                                      "code": "not_found"}})
    conf = CONF.format(directory=directory, keys_directory=keys_directory, limits_file=LIMITS_FILE, log=log,
                       upstreams=upstreams, choose=choose, host=g.host, port=g.port, max_bytes=s.max_request_bytes,
                       consumer_header=CONSUMER_HEADER, tpm_header=TPM_HEADER, usage_header=USAGE_HEADER, routed_header=ROUTED_MODEL_HEADER,
                       routed_value="$body_model" if g.models else '""', js_module=JS_MODULE, route_file=ROUTE_FILE,
                       max_new_tokens=s.max_new_tokens_limit, routed_models=", ".join(g.models) or "any",
                       routes=_routes(config), models_location=_models_location(config, unauthorized),
                       paddle_pass="proxy_pass http://paddle_http;" if paddle_backends(config) else
                       f"return 404 '{no_paddle}';",
                       read_timeout=int(s.request_timeout_s) + 30, tries=tries, unauthorized=unauthorized,
                       limited=limited, too_large=too_large)
    return conf, limits


def _routes(config) -> str:
    """The map from the body's model to the pool: gateway.models (to one pool, or $pool: the split's choice), else
    every model to $pool."""
    g = config.gateway
    if not g.models:
        return "        default $pool;"
    alone = set(fallbacks(config))
    return "        default \"\";\n" + "\n".join(
        f'        "{model}" {("only_" if pools[0] in alone else "pool_") + pools[0] if len(pools) == 1 else "$pool"};'
        for model, pools in g.models.items())


def _models_location(config, unauthorized: str) -> str:
    """GET /v1/models at the gateway: the names it routes (with gateway.models; else a replica answers)."""
    if not config.gateway.models:
        return ""
    listed = json.dumps({"object": "list", "data": [{"id": m, "object": "model", "owned_by": "paddle-train-to-serve"}
                                                    for m in config.gateway.models]}, ensure_ascii=False)
    return (f"        location = /v1/models {{\n            if ($consumer = \"\") {{\n                return 401 "
            f"'{unauthorized}';\n            }}\n            return 200 '{listed}';\n        }}")


def _limits(config, consumers: dict) -> tuple[str, str]:
    """(limits.conf: per-consumer maps and limit_req zones, requests.conf: the location's limit_req lines)."""
    g = config.gateway
    by_pool, names = pools(config), sorted(consumers)
    limits = ["# per-consumer limits (rendered from keys.json by make gateway-key: nginx reloads them)"]
    # Each replica enforces its share of a consumer's tokens per minute: the pool's share of the requests (split)
    # spread over its replicas (round robin), so the replicas together hold the consumer to its budget, give or
    # take one request per replica (serving/server/consumers.py)
    # (a pool outside the split serves models of its own: all of their requests)
    shares = {p: (g.split.get(p, 0) if g.split and p in g.split else 100) / 100 / len(urls)
              for p, urls in by_pool.items()}
    upstreams = [(f"pool_{p}", p) for p in by_pool] + [(f"only_{p}", p) for p in fallbacks(config)]
    limits.append('map "$route_pool $consumer" $consumer_tpm {\n    default 0;\n' + "".join(
        f'    "{u} {n}" {math.ceil(consumers[n]["tpm"] * shares[p]) if consumers[n].get("tpm") else 0};\n'
        for u, p in upstreams for n in names) + "}")
    limits.append("map $consumer $retry_after {\n    default 60;\n" + "".join(
        f'    "{n}" {max(1, -(-60 // int(consumers[n]["rpm"])))};\n' for n in names) + "}")
    zone = {n: "rpm_" + n.encode().hex() for n in names}  # (a consumer's zone keeps its name across reloads)
    for n in names:
        limits.append(f'map $consumer ${zone[n]} {{\n    default "";\n    "{n}" $consumer;\n}}\n'
                      f'limit_req_zone ${zone[n]} zone={zone[n]}:1m rate={int(consumers[n]["rpm"])}r/m;')
    request_limits = "".join(f"limit_req zone={zone[n]}" + (f" burst={int(consumers[n]['rpm']) - 1} nodelay"
                                                            if int(consumers[n]["rpm"]) > 1 else "") + ";\n"
                             for n in names)
    return "\n".join(limits) + "\n", request_limits


def fallbacks(config) -> dict[str, list[str]]:
    """{pool of the split: the other split pools' replicas}: when every replica of a pool is down, the pools that
    serve the same model take its share (as Envoy's and Istio's outlier detection would), and it gets its share back
    once it answers again (after gateway.fail_timeout_s). Pools outside the split serve models of their own."""
    g, by_pool = config.gateway, pools(config)
    split = [p for p in by_pool if g.split.get(p, 0) > 0] if g.split else []
    return {p: [u for other in split if other != p for u in by_pool[other]] for p in split}


AFFINITY_KEYS = {"consumer": "$consumer", "session": "$affinity_session"}  # (gateway.affinity -> the hash key)
SESSION_HEADER = "X-Session-Id"  # gateway.affinity=session: a conversation's requests share its value


def _upstream(name: str, urls: list[str], backups: list[str], fail_timeout_s: float, affinity: str = "none") -> str:
    hashed = f"        hash {AFFINITY_KEYS[affinity]} consistent;\n" if affinity in AFFINITY_KEYS else ""
    return (f"    upstream {name} {{\n" + hashed + "".join(
        f"        server {_address(u)} max_fails=1 fail_timeout={fail_timeout_s}s;\n" for u in urls) + "".join(
        f"        server {_address(u)} max_fails=1 fail_timeout={fail_timeout_s}s backup;\n" for u in backups) +
        "        keepalive 32;\n    }")


def _pools(config) -> tuple[str, str]:
    """(the upstream blocks: pool_<name> for each pool, the other split pools' replicas its backups; only_<name>, the
    pool alone, for a name routed to that one pool (an alias asked for by name is never answered by another
    version); how $pool is chosen: split_clients by weight, or the one pool)."""
    g, by_pool, backups = config.gateway, pools(config), fallbacks(config)
    upstreams = "\n".join(_upstream(f"pool_{name}", urls, backups.get(name, []), g.fail_timeout_s, g.affinity)
                           for name, urls in by_pool.items())
    if g.affinity == "session":  # (a request without the header: a random key, any replica)
        header = SESSION_HEADER.lower().replace("-", "_")
        upstreams += (f'\n    map $http_{header} $affinity_session {{\n        "" $request_id;\n'
                      f'        default $http_{header};\n    }}')
    upstreams += "".join("\n" + _upstream(f"only_{name}", by_pool[name], [], g.fail_timeout_s, g.affinity)
                         for name in backups)
    if paddle_backends(config):
        upstreams += "\n    upstream paddle_http {\n" + "".join(
            f"        server {_address(u)} max_fails=1 fail_timeout={g.fail_timeout_s}s;\n"
            for u in paddle_backends(config)) + "        keepalive 32;\n    }"
    if g.split:
        rest = [p for p in by_pool if g.split.get(p, 0) > 0]
        choose = ('    split_clients "${request_id}" $pool {\n' + "".join(
            f"        {g.split[p]}% pool_{p};\n" for p in rest[:-1]) + f"        * pool_{rest[-1]};\n    }}")
    else:
        choose = f'    map "" $pool {{\n        default pool_{next(iter(by_pool))};\n    }}'
    return upstreams, choose


def write(config, consumers: dict) -> Path:
    """The rendered files in the state directory (and an empty key map when there are no keys yet); returns
    nginx.conf's path, checked by `nginx -t`."""
    directory, key_dir = state_dir(config), keys.keys_dir(config)
    (directory / "limits.d").mkdir(parents=True, exist_ok=True)
    if not (key_dir / keys.MAP_FILE).is_file():
        key_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        atomic_write(key_dir / keys.MAP_FILE, "", mode=0o600)
    if not Path(JS_MODULE).is_file():
        raise ConfigError(NO_JS)
    conf, limits = render(config, directory, key_dir, consumers)
    atomic_write(directory / ROUTE_FILE, (Path(__file__).parent / ROUTE_FILE).read_text())
    atomic_write(directory / LIMITS_FILE, limits)
    atomic_write(directory / CONF_FILE, conf)
    checked = subprocess.run([binary(), "-t", "-q", "-c", str(directory / CONF_FILE), "-p", str(directory)],
                             capture_output=True, text=True)
    if checked.returncode != 0:
        lines = checked.stderr.strip().splitlines() or ["?"]
        raise ConfigError("the rendered gateway configuration is refused by nginx: " +
                          next((line for line in lines if "[emerg]" in line), lines[-1]))
    return directory / CONF_FILE


def consumers_of(config) -> dict:
    return {name: {"rpm": v["rpm"], "tpm": v.get("tpm", 0)} for name, v in keys.read(keys.keys_dir(config)).items()}


def running(config) -> dict | None:
    path = state_dir(config) / STATE_FILE
    if path.is_file():
        state = json.loads(path.read_text())
        if group_alive(state["pid"]):
            return state
    return None


def start(config, timeout_s: float = 20) -> dict:
    """Start nginx (or find it running: its configuration is rendered again and reloaded); returns its state."""
    state = running(config)
    if state:
        reload(config)
        return state
    g = config.gateway
    if port_in_use(g.port, "127.0.0.1" if g.host in ("0.0.0.0", "::") else g.host):
        raise ConfigError(f"gateway.port {g.port} is in use; stop what holds it or pick another port")
    conf = write(config, consumers_of(config))
    directory = state_dir(config)
    proc = start_group([binary(), "-c", str(conf), "-p", str(directory)], directory / "nginx.log", directory,
                       dict(os.environ))
    host = "127.0.0.1" if g.host in ("0.0.0.0", "::") else g.host
    state = {"pid": proc.pid, "url": f"http://{host}:{g.port}", "host": g.host, "port": g.port,
             "pools": pools(config), "split": g.split}
    atomic_write(directory / STATE_FILE, json.dumps(state))

    def answers() -> bool:
        with urllib.request.urlopen(f"{state['url']}/gateway/health", timeout=2) as reply:
            return reply.status == 200

    if wait_ready(proc, answers, timeout_s, 0.05) != "ready":
        stop(config)
        raise ConfigError("the gateway did not start; last lines of its error log:\n" +
                          log_tail(directory / "error.log", 10) + log_tail(directory / "nginx.log", 10))
    return state


def reload(config, timeout_s: float = 5) -> bool:
    """Render again and have the running nginx take the new configuration (SIGHUP: new workers with it, the old
    ones finish the requests they hold); False when no gateway runs. Returns once the new workers run."""
    state = running(config)
    write(config, consumers_of(config))
    if not state:
        return False
    directory = state_dir(config)
    before = _workers(int((directory / "nginx.pid").read_text()))
    os.kill(int((directory / "nginx.pid").read_text()), signal.SIGHUP)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        # in force once a new worker runs and every old one has stopped taking connections (nginx retitles it
        # "worker process is shutting down" and lets it finish the requests it holds)
        now = _workers(int((directory / "nginx.pid").read_text()))
        if now - before and all(not _accepting(pid) for pid in before & now):
            return True
        time.sleep(0.01)
    raise ConfigError("the gateway did not take the new configuration; see " + str(directory / "error.log"))


def _accepting(pid: int) -> bool:
    try:
        return b"shutting down" not in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _workers(master: int) -> set[int]:
    return set(children_map().get(master, []))


def stop(config) -> bool:
    return stop_recorded(state_dir(config) / STATE_FILE, steps=((15, 10.0), (9, 5.0)))
