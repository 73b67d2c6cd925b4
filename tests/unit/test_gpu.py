"""GPU settings as far as a CPU machine can check them: what a serving config asks Paddle Inference for (a recording
fake of `paddle.inference.Config`), where each worker goes, the CUDA library path of a pip-built GPU environment,
and the doctor's report here."""
import os
import sys
from pathlib import Path

import pytest

from core import exportdir
from serving.engine import runtime
from core.config import ConfigError, load_config
from core.workarounds import cuda_libraries


class RecordingConfig:
    calls: list = []

    def __init__(self, model, params):
        self.calls.append(("Config", Path(model).name, Path(params).name))

    def __getattr__(self, name):
        return lambda *args: self.calls.append((name, *args))


@pytest.fixture
def recorded(monkeypatch):
    from paddle import inference

    RecordingConfig.calls = []
    monkeypatch.setattr(inference, "Config", RecordingConfig)
    monkeypatch.setattr(inference, "create_predictor", lambda config: "predictor")
    return RecordingConfig.calls


def test_a_cpu_predictor_asks_for_no_gpu(recorded):
    assert runtime.create_predictor(Path("/x"), threads=3) == "predictor"
    names = [c[0] for c in recorded]
    assert ("disable_gpu",) in recorded and ("set_cpu_math_library_num_threads", 3) in recorded
    assert ("switch_ir_optim", False) in recorded and "enable_use_gpu" not in names


@pytest.mark.parametrize("precision, kind, ir_optim", [("float32", "Float32", False), ("float16", "Half", True),
                                                       ("bfloat16", "Bfloat16", True)])
def test_a_gpu_predictor_asks_for_its_device_memory_and_precision(recorded, precision, kind, ir_optim):
    from paddle import inference

    placement = runtime.Placement("gpu", 3, 2048, precision)
    runtime.create_predictor(Path("/x"), prefix=exportdir.DECODE_PREFIX, threads=4, placement=placement)
    assert recorded[0] == ("Config", "decode.pdmodel", "decode.pdiparams")
    assert ("enable_use_gpu", 2048, 3, getattr(inference.PrecisionType, kind)) in recorded
    assert ("switch_ir_optim", ir_optim) in recorded
    names = [c[0] for c in recorded]
    assert "disable_gpu" not in names and "set_cpu_math_library_num_threads" not in names


def test_the_cache_session_passes_the_placement_to_both_programs(recorded, tmp_path, monkeypatch):
    monkeypatch.setattr(runtime, "create_predictor", lambda d, prefix, threads, placement: FakeDecode(prefix,
                                                                                                        placement))
    runtime.cache_session(tmp_path, 1, runtime.Placement("gpu", 1))
    assert FakeDecode.made == [("prefill", "gpu:1 float32"), ("decode", "gpu:1 float32")]


class FakeDecode:
    made: list = []

    def __init__(self, prefix, placement):
        self.made.append((prefix, placement.describe()))

    def get_input_names(self):
        return [exportdir.PAST_KINDS[0]]  # (the earlier stacked form: no handles needed)


def serving(*overrides):
    return load_config(None, list(overrides)).serving


def test_workers_and_their_gpus(monkeypatch):
    from serving.engine import placement

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    placed = placement.placements(serving("serving.device=gpu", "serving.precision=float16"))
    assert [(p.device, p.device_id, p.precision) for p in placed] == [("gpu", 0, "float16"), ("gpu", 1, "float16")]
    placed = placement.placements(serving("serving.device=gpu", "serving.gpus=[1]", "serving.workers=3"))
    assert [p.device_id for p in placed] == [1, 1, 1]
    with pytest.raises(ConfigError, match=r"serving.gpus: \[4\] not among the 2 visible"):
        placement.placements(serving("serving.device=gpu", "serving.gpus=[4]"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(ConfigError, match="serving.device=gpu: no GPU visible"):
        placement.placements(serving("serving.device=gpu"))
    from core.workarounds import cpu_runtime
    from serving.server.sizes import predictor_threads

    assert placement.placements(serving()) == [runtime.Placement()] * cpu_runtime.available_cores()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    assert predictor_threads(serving("serving.device=gpu")) == 1


def test_the_worker_reads_the_placement_the_dispatcher_sends(monkeypatch):
    from serving.engine import worker
    from serving.engine.dispatch import placement_args

    sent = runtime.Placement("gpu", 2, 512, "bfloat16")
    seen = {}
    monkeypatch.setattr(sys, "argv", ["worker", "--model", "m", "--fd", "9", *placement_args(sent)])
    monkeypatch.setattr(worker, "ExportedModel", lambda d: (_ for _ in ()).throw(SystemExit(0)))
    monkeypatch.setattr("core.processes.die_with_parent", lambda: None)
    monkeypatch.setattr(worker, "Connection", lambda fd: seen.setdefault("fd", fd))
    real = runtime.Placement.__init__

    def spy(self, *args):
        real(self, *args)
        seen["placement"] = self

    monkeypatch.setattr(runtime.Placement, "__init__", spy)
    with pytest.raises(SystemExit):
        worker.main()
    assert seen["placement"] == sent and seen["fd"] == 9


def test_a_reduced_precision_is_checked_against_float32():
    import numpy as np

    from serving.engine.placement import check_precision

    base = np.linspace(-3, 3, 40).reshape(1, 2, 20)
    ok = runtime.Placement("gpu", 0, 64, "float16")
    assert check_precision("x", ok, lambda p: base + (0.01 if p.precision == "float16" else 0)) == pytest.approx(0.01)
    with pytest.raises(ConfigError, match=r"serving.precision=float16: logits differ from float32 by 0.5"):
        check_precision("x", ok, lambda p: base + (0.5 if p.precision == "float16" else 0))
    assert check_precision("x", runtime.Placement(), lambda p: 1 / 0) == 0.0  # (float32: nothing to compare)


def test_precision_and_gpus_need_serving_on_gpu():
    with pytest.raises(ConfigError, match="serving.precision: float16 needs serving.device=gpu"):
        serving("serving.precision=float16")
    with pytest.raises(ConfigError, match="serving.gpus: only with serving.device=gpu"):
        serving("serving.gpus=[0]")


def fake_nvidia(root: Path) -> None:
    for package, target in cuda_libraries.LIBRARIES.values():
        (root / "nvidia" / package / "lib").mkdir(parents=True, exist_ok=True)
        (root / "nvidia" / package / "lib" / target).write_bytes(b"\x7fELF")


def test_cuda_libraries_get_unversioned_links_first_on_the_library_path(tmp_path, monkeypatch):
    fake_nvidia(tmp_path / "site")
    monkeypatch.setattr(cuda_libraries, "nvidia_root", lambda: tmp_path / "site" / "nvidia")
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "venv"))
    (tmp_path / "venv").mkdir()
    monkeypatch.setenv("LD_LIBRARY_PATH", "/opt/other")
    folder = cuda_libraries.make_links()
    assert os.readlink(folder / "libcudnn.so") == str(tmp_path / "site/nvidia/cudnn/lib/libcudnn.so.8")
    assert os.readlink(folder / "libnvrtc.so").endswith("cuda_nvrtc/lib/libnvrtc.so.11.2")
    assert sorted(p.name for p in folder.iterdir()) == sorted(cuda_libraries.LIBRARIES)
    path = cuda_libraries.library_path().split(os.pathsep)
    assert path[0] == str(folder) and path[-1] == "/opt/other"
    assert str(tmp_path / "site/nvidia/cudnn/lib") in path and not cuda_libraries.configured()

    execs = []
    monkeypatch.setattr(os, "execve", lambda exe, argv, env: execs.append((exe, argv, env["LD_LIBRARY_PATH"])))
    monkeypatch.setattr(sys, "orig_argv", ["python", "-m", "pipeline", "train"])
    cuda_libraries.apply()
    assert execs == [(sys.executable, [sys.executable, "-m", "pipeline", "train"], os.pathsep.join(path))]
    assert cuda_libraries.configured()  # (the re-executed process does nothing more)
    cuda_libraries.apply()
    assert len(execs) == 1


def test_a_cpu_environment_is_left_alone(tmp_path, monkeypatch):
    monkeypatch.setattr(cuda_libraries, "nvidia_root", lambda: tmp_path / "none")
    monkeypatch.setattr(os, "execve", lambda *a: pytest.fail("re-executed a CPU environment"))
    cuda_libraries.apply()


def test_the_doctor_on_this_cpu_machine(capsys):
    from pipeline import doctor

    assert doctor.run(load_config(None, ["parallel.data=2", "parallel.micro_batch_size=8"])) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("ok  paddle     2.6.2, CPU build")
    assert "device cpu: dp2, 2 process(es), gloo between them" in out[1] and out[-1] == "ready"
    assert doctor.run(load_config(None, ["parallel.device=gpu"])) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[1] == ("FIX layout     parallel.device=gpu needs the GPU build: make setup DEVICE=gpu (or "
                      "parallel.device=cpu)") and out[-1] == "1 problem(s)"
