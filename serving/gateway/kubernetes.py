"""The gateway on Kubernetes: `deploy/kubernetes/gateway.yaml` rendered from the same settings and the same
nginx.conf as `make gateway` (nginx.py render), in front of deploy/kubernetes/serving.yaml's Service.

    ConfigMap paddle-gateway        nginx.conf, route.js (njs: the official nginx image has the module) and the
                                    per-consumer limits (names and rates: no keys)
    Secret    paddle-gateway-keys   keys.map (the operator creates it from gateway.keys_dir: never in the repository)
    Deployment / Service            nginx (Debian's 1.22 image line), the one listener meant for clients

`python -m serving.gateway.kubernetes > deploy/kubernetes/gateway.yaml` writes it again for the keys in
gateway.keys_dir (their limits; the keys themselves go only into the Secret); tests/unit/test_gateway_config.py
checks the checked-in file equals the rendering for no consumers.
"""
from __future__ import annotations

import sys
from pathlib import Path
import tempfile

import yaml

from core.config import DEFAULT_CONFIG, load_config
from serving.gateway import nginx

CONF_DIR, KEYS_DIR, STATE_DIR = Path("/etc/gateway/conf"), Path("/etc/gateway/keys"), Path("/tmp/gateway")
SERVICE = "http://paddle-serve:18182"  # deploy/kubernetes/serving.yaml's Service, api port
PADDLE_SERVICE = "http://paddle-serve:18180"  # its Paddle Serving HTTP port
IMAGE = "nginx:1.22"


def manifest(config, consumers: dict) -> str:
    config = config.with_overrides([f"gateway.backends=[{SERVICE}]", "gateway.split={}", "gateway.models={}",
                                     f"gateway.paddle_backends=[{PADDLE_SERVICE}]", "gateway.host=0.0.0.0"])
    with tempfile.TemporaryDirectory() as scratch:  # (render writes limits.d/requests.conf beside the state)
        conf, limits = nginx.render(config, Path(scratch), KEYS_DIR, consumers)
        requests = (Path(scratch) / "limits.d" / "requests.conf").read_text()
    # in the pod: the configuration read-only from the ConfigMap, state (pid, temp files) in an emptyDir, logs to
    # the container's output
    conf = (conf.replace(f"{Path(scratch)}/{nginx.LIMITS_FILE}", f"{CONF_DIR}/{nginx.LIMITS_FILE}")
            .replace(f"{Path(scratch)}/limits.d/requests.conf", f"{CONF_DIR}/requests.conf")
            .replace(f"{Path(scratch)}/{nginx.ROUTE_FILE}", f"{CONF_DIR}/{nginx.ROUTE_FILE}")
            .replace(f"{Path(scratch)}/access.log", "/dev/stdout").replace(f"{Path(scratch)}/error.log", "stderr")
            .replace(str(Path(scratch)), str(STATE_DIR)))
    port = config.gateway.port
    labels = {"app": "paddle-gateway"}
    docs = [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "paddle-gateway"},
         "data": {"nginx.conf": conf, nginx.LIMITS_FILE: limits, "requests.conf": requests,
                  nginx.ROUTE_FILE: (Path(nginx.__file__).parent / nginx.ROUTE_FILE).read_text()}},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "paddle-gateway", "labels": labels},
         "spec": {"replicas": 2, "selector": {"matchLabels": labels}, "template": {
             "metadata": {"labels": labels},
             "spec": {"containers": [{
                 "name": "nginx", "image": IMAGE,
                 "command": ["nginx", "-c", f"{CONF_DIR}/nginx.conf", "-p", str(STATE_DIR)],
                 "ports": [{"name": "gateway", "containerPort": port}],
                 "readinessProbe": {"httpGet": {"path": "/gateway/health", "port": "gateway"}},
                 "livenessProbe": {"httpGet": {"path": "/gateway/health", "port": "gateway"}},
                 "volumeMounts": [{"name": "conf", "mountPath": str(CONF_DIR), "readOnly": True},
                                  {"name": "keys", "mountPath": str(KEYS_DIR), "readOnly": True},
                                  {"name": "state", "mountPath": str(STATE_DIR)}]}],
                 "volumes": [{"name": "conf", "configMap": {"name": "paddle-gateway"}},
                             {"name": "keys", "secret": {"secretName": "paddle-gateway-keys"}},
                             {"name": "state", "emptyDir": {}}]}}}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "paddle-gateway"},
         "spec": {"type": "LoadBalancer", "selector": labels,
                  "ports": [{"name": "gateway", "port": 80, "targetPort": "gateway"}]}},
    ]
    header = ("# Rendered by `python -m serving.gateway.kubernetes` (serving/gateway/kubernetes.py) from the gateway\n"
              "# settings: edits are overwritten. The keys are not here: create their Secret from gateway.keys_dir:\n"
              "#   kubectl create secret generic paddle-gateway-keys --from-file=keys.map=<keys_dir>/keys.map\n"
              "# then: kubectl apply -f deploy/kubernetes/serving.yaml -f deploy/kubernetes/gateway.yaml\n")
    return header + yaml.dump_all(docs, Dumper=_Literal, sort_keys=False, allow_unicode=True, width=120)


class _Literal(yaml.SafeDumper):
    """Multi-line strings (the configuration files) as YAML literal blocks: the ConfigMap reads as the files."""


_Literal.add_representer(str, lambda dumper, text: dumper.represent_scalar(
    "tag:yaml.org,2002:str", text, style="|" if "\n" in text else None))


def main(argv: list[str]) -> int:
    import core  # noqa: F401

    config = load_config(DEFAULT_CONFIG, argv)
    sys.stdout.write(manifest(config, nginx.consumers_of(config)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
