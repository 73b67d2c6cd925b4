"""Export: best run and checkpoint from MLflow, static graph parity, registry versions, and the refusals."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers import cli, env_for, wait_until
from core import REPO_ROOT, exportdir, tracking
pytestmark = pytest.mark.slow


def test_export_of_the_best_run(exported):
    out = exported["export_stdout"]
    export_dir = exported["export_dir"]
    meta = json.loads((export_dir / "export.json").read_text())
    assert "checkpoint step 12" in out and "parity: max |dynamic - paddle.inference|" in out
    assert "registered model 'test-model' version 1" in out
    assert meta["checkpoint_step"] == 12 and meta["parity_max_abs_error"] <= meta["parity_tolerance"] == 1e-4
    for name in ("model.pdmodel", "model.pdiparams", "serving_server_conf.prototxt", "tokenizer/vocab.txt"):
        assert (export_dir / name).is_file(), name
    client = tracking.client(exported["uri"])
    version = client.get_model_version("test-model", "1")
    assert version.run_id == meta["source_run_id"] and version.tags["export_dir"] == str(export_dir)
    assert float(version.tags["parity_max_abs_error"]) == pytest.approx(meta["parity_max_abs_error"], rel=1e-2)
    # the registered version's source is the run's copy of the export directory (works with any tracking server)
    assert version.source == f"runs:/{meta['source_run_id']}/exports/test-model/v1" == meta["artifact_uri"]
    logged = {a.path for a in client.list_artifacts(meta["source_run_id"], "exports/test-model/v1")}
    assert {f"exports/test-model/v1/{name}" for name in ("model.pdmodel", "model.pdiparams", "model.pdiparams.info",
                                                          "prefill.pdmodel", "prefill.pdiparams",
                                                          "prefill.pdiparams.info", "decode.pdmodel",
                                                          "decode.pdiparams", "decode.pdiparams.info",
                                                          "extend.pdmodel", "extend.pdiparams", "extend.pdiparams.info",
                                                          "export.json", "reference.json",
                                                          "serving_server_conf.prototxt", "tokenizer",
                                                          # MLflow's metadata of the python_function flavor
                                                          "MLmodel", "python_model.pkl", "code", "requirements.txt",
                                                          "python_env.yaml", "conda.yaml", "input_example.json",
                                                          "serving_input_example.json")} == logged
    assert not list(export_dir.parent.glob(".staging-*"))
    # greedy tokens of the graph equal the dynamic model's, recorded for smoke (serving needs no checkpoint)
    assert "greedy tokens: exported graph == cache programs (alone and batched) == dynamic model for 5 prompts" in out
    assert "(prefill + decode, and extend at every block split, padded batch)" in out
    references = exportdir.read_references(export_dir)
    assert set(references) == set(exportdir.REFERENCE_PROMPTS)
    assert all(1 <= len(ids) <= exportdir.REFERENCE_NEW_TOKENS for ids in references.values())
    assert exportdir.is_complete(export_dir)


def test_exported_graph_loads_in_a_fresh_process(exported, tmp_path):
    from model.llama import load_merged

    import paddle

    meta = json.loads((exported["export_dir"] / "export.json").read_text())
    ids = np.random.RandomState(3).randint(5, meta["vocab_size"], size=(2, 11)).astype("int64")
    model = load_merged(meta["checkpoint"])
    model.eval()
    with paddle.no_grad():
        expected = model(paddle.to_tensor(ids), use_cache=False, return_dict=False)[0].numpy()
    np.save(tmp_path / "ids.npy", ids)
    code = ("import core, sys, numpy as np\n"
            "from pathlib import Path\n"
            "from serving.engine.runtime import create_predictor, predict\n"
            "p = create_predictor(Path(sys.argv[1]))\n"
            "np.save(sys.argv[3], predict(p, np.load(sys.argv[2])))\n")
    subprocess.run([sys.executable, "-c", code, str(exported["export_dir"]), str(tmp_path / "ids.npy"),
                    str(tmp_path / "out.npy")], check=True, cwd=REPO_ROOT, env=env_for(exported["uri"]))
    assert np.abs(np.load(tmp_path / "out.npy") - expected).max() < 1e-4


def test_registered_version_loads_with_mlflow_pyfunc_in_a_fresh_process(exported, tmp_path):
    """What a notebook does: the tracking URI and `models:/<name>/<version>`, nothing of this repository on the
    path (the model brings its code) -- the recorded greedy continuations, token for token, and the signature."""
    references = exportdir.read_references(exported["export_dir"])
    code = ("import json, sys, mlflow, pandas as pd\n"
            "model = mlflow.pyfunc.load_model('models:/test-model/1')\n"
            "prompts = json.loads(sys.argv[1])\n"
            "out = model.predict(pd.DataFrame({'prompt': prompts, 'max_new_tokens': [8] * len(prompts)}))\n"
            "info = mlflow.models.get_model_info('models:/test-model/1')\n"
            "print(json.dumps({'tokens': [list(map(int, t)) for t in out['token_ids']], 'text': list(out['text']),\n"
            "                  'inputs': info.signature.inputs.input_names(),\n"
            "                  'outputs': info.signature.outputs.input_names()}))\n")
    env = {k: v for k, v in env_for(exported["uri"]).items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(list(references))], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["tokens"] == list(references.values())
    assert all(isinstance(t, str) and t for t in got["text"])
    assert got["inputs"] == ["prompt", "max_new_tokens", "temperature", "top_k", "top_p", "seed"]
    assert got["outputs"] == ["text", "token_ids"]


def test_mlflow_models_serve_answers_over_its_rest_route(exported, tmp_path):
    import os
    import signal

    import requests

    from helpers import free_port

    port = free_port()
    # as from an activated environment: MLflow execs `uvicorn` from PATH
    env = {**env_for(exported["uri"]), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "models", "serve", "-m", "models:/test-model/1",
                             "--env-manager", "local", "-h", "127.0.0.1", "-p", str(port)], cwd=tmp_path,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        def pinged() -> bool:
            try:
                return requests.get(f"http://127.0.0.1:{port}/ping", timeout=2).status_code == 200
            except requests.ConnectionError:
                return False

        assert wait_until(pinged, 120, 0.5, alive=proc, context=lambda: proc.stderr.read()[-3000:]), \
            "mlflow models serve did not come up"
        prompt, tokens = next(iter(exportdir.read_references(exported["export_dir"]).items()))
        answer = requests.post(f"http://127.0.0.1:{port}/invocations", timeout=60,
                               json={"dataframe_records": [{"prompt": prompt, "max_new_tokens": 8}]})
        assert answer.status_code == 200, answer.text
        assert answer.json()["predictions"][0]["token_ids"] == tokens
        bad = requests.post(f"http://127.0.0.1:{port}/invocations", json={"dataframe_records": [{"prompt": ""}]},
                            timeout=60)
        assert bad.status_code >= 400 and "prompt" in bad.text
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def test_another_export_is_the_next_version(exported):
    """Whatever ran before in this session: the next export is the registry's next version, in its own directory."""
    run_id = json.loads((exported["export_dir"] / "export.json").read_text())["source_run_id"]
    client = tracking.client(exported["uri"])
    latest = max(int(v.version) for v in client.search_model_versions("name='test-model'"))
    proc = cli(["export", "--run-id", run_id], exported["uri"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"version {latest + 1}" in proc.stdout
    assert (exported["root"] / "exports" / "test-model" / str(latest + 1) / "export.json").is_file()


def _published(exported):
    client = tracking.client(exported["uri"])
    return (sorted(p.name for p in (exported["root"] / "exports" / "test-model").iterdir()),
            len(client.search_model_versions("name='test-model'")))


def test_export_refusals_publish_nothing(exported, tmp_path, monkeypatch, capsys):
    client = tracking.client(exported["uri"])
    before = _published(exported)
    # (an experiment of their own: a "best run" selection of the shared experiment must never pick these runs)
    experiment = client.create_experiment("export-refusals", artifact_location=(tmp_path / "artifacts").as_uri())

    # a finished run with no checkpoints
    empty_run = client.create_run(experiment, run_name="no-checkpoints")
    client.log_metric(empty_run.info.run_id, "eval_loss", 1.0)
    client.set_terminated(empty_run.info.run_id, "FINISHED")

    # a run whose best checkpoint is truncated
    damaged = tmp_path / "damaged"
    shutil.copytree(exported["run_dir"], damaged)
    checkpoint = damaged / "checkpoints" / "checkpoint-12"
    weights = next(checkpoint.glob("model-*.safetensors"))
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    bad_run = client.create_run(experiment, run_name="damaged")
    client.log_dict(bad_run.info.run_id, {"step": 12, "path": str(checkpoint), "eval_loss": 0.5},
                    "checkpoints/checkpoint-12.json")
    client.set_terminated(bad_run.info.run_id, "FINISHED")

    client.create_experiment("nothing-finished", artifact_location=(tmp_path / "nothing").as_uri())
    cases = [
        (["--run-id", "0123456789abcdef0123456789abcdef"], "no such MLflow run"),
        (["--run-id", empty_run.info.run_id], "has no checkpoint"),
        (["--run-id", bad_run.info.run_id], "is unreadable"),
        (["--experiment", "nothing-finished"], "has no FINISHED run"),
        (["--experiment", "no-such-experiment"], "no such MLflow experiment"),
    ]
    # the first through `python -m pipeline` as a user runs it (exit code 2, one line), the rest through the same
    # entry point in this process (the CLI's start-up is most of each case's time)
    args, message = cases[0]
    proc = cli(["export", *args], exported["uri"])
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, (args, proc.stderr[-2000:])
    assert proc.stderr.startswith("error: ") and message in proc.stderr, (args, proc.stderr[-2000:])
    from pipeline.__main__ import main

    monkeypatch.setenv("MLFLOW_TRACKING_URI", exported["uri"])
    for args, message in cases[1:]:
        capsys.readouterr()
        assert main(["export", *args]) == 2, args
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err, (args, err[-2000:])
        assert _published(exported) == before, args
