"""The job files users submit (deploy/): the Slurm batch script and the Kubeflow PaddleJob manifest both run
deploy/train-node.sh with the same environment contract, and what they run dry-runs here: a new run, then (the run
directory existing, as after a requeue or a pod restart) a resume of the same run."""
import os
import subprocess

import pytest
import yaml

from core import REPO_ROOT
DEPLOY = REPO_ROOT / "deploy"
SBATCH = DEPLOY / "slurm" / "train.sbatch"
PADDLEJOB = DEPLOY / "kubernetes" / "paddlejob-train.yaml"
PADDLEJOB_LOCAL_DISK = DEPLOY / "kubernetes" / "paddlejob-train-local-disk.yaml"  # (no ReadWriteMany volume)


@pytest.mark.parametrize("script", [SBATCH, DEPLOY / "train-node.sh"])
def test_scripts_parse(script):
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    assert os.access(script, os.X_OK)


def _fake_slurm(bin_dir):
    """srun: runs the task once, as node 0 (drops its options); scontrol: the job's two hostnames."""
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\nexport SLURM_NODEID=0\n'
                                  'exec "$@"\n')
    (bin_dir / "scontrol").write_text('#!/bin/bash\n[ "$1 $2" = "show hostnames" ] && printf "gpu-a\\ngpu-b\\n"\n')
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)


def test_sbatch_script_dry_runs_a_new_run_then_the_requeued_one(tmp_path):
    _fake_slurm(tmp_path / "bin")
    runs = tmp_path / "shared-runs"
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "SLURM_SUBMIT_DIR": str(REPO_ROOT),
           "SLURM_JOB_NAME": "llama", "SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "64",
           "SLURM_JOB_NODELIST": "gpu-[a-b]", "RUNS_DIR": str(runs), "DRY_RUN": "1",
           "DEVICE": "cpu"}  # (the Paddle build of this machine; a cluster's is gpu, the scripts' default)
    env.pop("NODE_RANK", None)
    proc = subprocess.run(["bash", str(SBATCH)], env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"node 0: new run {runs}/llama-4242" in proc.stdout
    assert "layout dp4-tp8-pp16: world size 512" in proc.stdout and "(64 node(s) x 8 process(es)" in proc.stdout
    # the dry run shows the performance settings exactly as they will reach PaddleNLP
    assert "LlamaConfig: use_flash_attention=True, use_fused_rms_norm=True, use_fused_rope=True" in proc.stdout
    assert "TrainingArguments: amp_master_grad=True" in proc.stdout
    # requeued: the run directory exists on the shared storage -> the same command resumes it
    (runs / "llama-4242").mkdir(parents=True)
    from core.config import load_config

    config = load_config(REPO_ROOT / "configs" / "llama-100b-512gpu.yaml",
                         [f"training.runs_dir={runs}", "training.run_name=llama-4242"])
    (runs / "llama-4242" / "config.yaml").write_text(config.to_yaml())
    proc = subprocess.run(["bash", str(SBATCH)], env={**env, "SLURM_RESTART_COUNT": "1"}, capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"node 0: continuing {runs}/llama-4242" in proc.stdout and "world size 512" in proc.stdout


@pytest.mark.parametrize("manifest", [PADDLEJOB, PADDLEJOB_LOCAL_DISK])
def test_paddlejob_manifest_runs_the_node_script_with_the_contract(tmp_path, manifest):
    job = yaml.safe_load(manifest.read_text())
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PaddleJob")
    worker = job["spec"]["paddleReplicaSpecs"]["Worker"]
    pod = worker["template"]["spec"]
    container = pod["containers"][0]
    assert container["name"] == "paddle"  # the operator finds its port and container by this name
    env = {e["name"]: e for e in container["env"]}
    assert env["NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.labels['training.kubeflow.org/replica-index']"
    assert int(env["NNODES"]["value"]) == worker["replicas"]
    assert pod["terminationGracePeriodSeconds"] > 25  # longer than training.stop_grace_s: SIGTERM saves first
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert any(env["RUNS_DIR"]["value"].startswith(m) for m in mounts)
    # the container's command, as the pod runs it (PADDLE_MASTER and the replica index as the operator sets them)
    runs = tmp_path / "runs"
    run_env = {**os.environ, **{k: e["value"] for k, e in env.items() if "value" in e},
               "PADDLE_MASTER": "paddle-train-worker-0:36789", "NODE_RANK": "0", "RUNS_DIR": str(runs),
               "DRY_RUN": "1", "DEVICE": "cpu"}
    run_env.pop("MASTER", None)
    proc = subprocess.run([*container["command"], *container["args"]], env=run_env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"node 0: new run {runs}/{env['RUN_NAME']['value']}" in proc.stdout
    assert "world size 512" in proc.stdout
    if manifest == PADDLEJOB_LOCAL_DISK:  # (its settings are a valid config: the dry run validated them)
        assert "storage.shared_filesystem=false" in env["EXTRA_ARGS"]["value"]
        assert not [v for v in pod["volumes"] if "persistentVolumeClaim" in v]


SERVING = DEPLOY / "kubernetes" / "serving.yaml"


SERVING_GPU = DEPLOY / "kubernetes" / "serving-gpu.yaml"


@pytest.mark.parametrize("manifest", [SERVING, SERVING_GPU], ids=["cpu", "gpu"])
def test_serving_manifest_matches_the_servers_cli_routes_and_ports(manifest, monkeypatch):
    """The Deployment runs the real `serve --foreground` command line (it parses, its config loads), its probes use
    the server's real health routes on the api port, the Service exposes the config's four ports, and the pod's
    grace period outlasts the drain. The GPU variant serves on GPU with one worker per GPU the pod gets."""
    from pipeline.__main__ import parser, verb_config
    from serving.server.openai import api_server as api

    deployment, service = yaml.safe_load_all(manifest.read_text())
    assert (deployment["kind"], service["kind"]) == ("Deployment", "Service")
    pod = deployment["spec"]["template"]
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"] == pod["metadata"]["labels"]
    container = pod["spec"]["containers"][0]
    assert container["command"][1:3] == ["-m", "pipeline"]
    args = parser().parse_args(container["command"][3:])
    assert args.verb == "serve" and args.foreground and args.model.startswith("models:/")
    config = verb_config(args)
    s = config.serving
    assert s.host == "0.0.0.0"  # probes and the Service reach the pod's address, not its loopback
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert named == {"http": s.http_port, "grpc": s.rpc_port, "api": s.api_port, "metrics": s.metrics_port}
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == named
    probes = {kind: container[kind]["httpGet"] for kind in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert probes["livenessProbe"]["path"] == api.LIVE and probes["readinessProbe"]["path"] == api.READY
    assert all(p["path"] in api.ROUTES["GET"] and p["port"] == "api" for p in probes.values())
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(s.metrics_port)
    assert pod["spec"]["terminationGracePeriodSeconds"] > s.drain_grace_s
    assert "MLFLOW_TRACKING_URI" in {e["name"] for e in container["env"]}  # models:/ is fetched from the registry
    if manifest is SERVING_GPU:
        gpus = container["resources"]["limits"]["nvidia.com/gpu"]
        assert container["resources"]["requests"]["nvidia.com/gpu"] == gpus >= 1
        assert pod["spec"]["nodeSelector"] and s.device == "gpu" and s.workers == 0
        from serving.engine.placement import placements

        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(str(i) for i in range(gpus)))  # (what the plugin sets)
        assert [p.device_id for p in placements(s)] == list(range(gpus))
    else:
        assert s.device == "cpu" and "nvidia.com/gpu" not in container["resources"]["requests"]
