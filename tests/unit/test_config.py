"""The typed config: every bad input fails before anything starts, with a message naming the key."""
import pytest

from core import REPO_ROOT
from core.config import DEFAULT_CONFIG, ConfigError, load_config


def write(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_defaults_and_shipped_configs_validate():
    assert load_config(None).training.max_steps > 0
    shipped = sorted((REPO_ROOT / "configs").glob("*.yaml"))
    assert len(shipped) >= 9  # tiny (the default), tiny-small (layout base) + 6 CPU layouts + the 512-GPU example
    small = load_config(REPO_ROOT / "configs" / "tiny-small.yaml")
    for path in shipped:
        config = load_config(path)
        layout = config.layout()
        assert config.name == path.stem, path
        if path.stem in ("tiny", "tiny-small"):
            assert layout.name == "single", path
        elif path.stem in ("tiny-chat", "tiny-chat-tools"):  # (make finetune's: the base's model, its own settings)
            assert layout.name == "single" and config.finetune.data == "reviews", path
            assert (config.finetune.tool_share > 0) == (path.stem == "tiny-chat-tools"), path
        elif path.stem.startswith("tiny-"):  # each layout config is the layout its name says, at the same batch
            assert layout.name.replace("-", "") == path.stem.removeprefix("tiny-"), path
            assert layout.global_batch_size == small.training.global_batch_size, path
            assert config.model == small.model and config.training == small.training, path
        else:
            assert layout.world_size == 512, path
    assert DEFAULT_CONFIG.name == "tiny.yaml"
    default = load_config(DEFAULT_CONFIG)
    assert default.model == small.model and default.training.compile and not small.training.compile


@pytest.mark.parametrize("text, message", [
    ("training:\n  max_stepz: 3\n", "unknown key training.max_stepz"),
    ("bogus: 1\n", "unknown key bogus"),
    ("training:\n  max_steps: ten\n", "training.max_steps: expected an integer"),
    ("training:\n  max_steps: 2.5\n", "training.max_steps: expected an integer"),
    ("parallel:\n  recompute: 3\n", "parallel.recompute: expected true or false"),
    ("training:\n  max_steps: -4\n", "training.max_steps: must be > 0"),
    ("training:\n  lr_scheduler: wavy\n", "training.lr_scheduler: 'wavy' is not allowed"),
    ("training:\n  save_interval: 30\n  eval_interval: 20\n", "must be a multiple of training.eval_interval"),
    ("data:\n  source: files\n", "data.files: list at least one"),
    ("training: [1, 2]\n", "training: expected a mapping"),
])
def test_bad_values_name_the_key(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(")):
        load_config(write(tmp_path, text))


def test_malformed_yaml_says_where(tmp_path):
    with pytest.raises(ConfigError, match=r"malformed YAML at line \d+, column \d+"):
        load_config(write(tmp_path, "training:\n  max_steps: [1\n"))


def test_non_utf8_config_says_where(tmp_path):
    path = tmp_path / "gbk.yaml"
    path.write_bytes("training:\n  max_steps: 3\n".encode() + "# 训练\n".encode("gbk"))
    with pytest.raises(ConfigError, match=r"gbk.yaml: not UTF-8 text \(byte 0xc1 at line 3\)"):
        load_config(path)


@pytest.mark.parametrize("override, message", [
    ("tracking.checkpoint_artifacts=some", "tracking.checkpoint_artifacts: 'some' is not allowed"),
    ("training.stop_grace_s=0", "training.stop_grace_s: must be > 0"),
    ("tracking.stale_after_s=30", "tracking.stale_after_s: must be at least 2 x tracking.heartbeat_s"),
    ("storage.shared_filesystem=false", "storage.shared_filesystem=false: the nodes meet in the object store; set "
                                        "storage.uri"),
    ("data.cache_dir=gs://bucket/data", "data.cache_dir=gs://bucket/data: a local directory, or `store`"),
    ("data.cache_dir=s3://bucket/data", "data.cache_dir=store puts the sets under <prefix>/data"),
    ("data.cache_dir=store", "data.cache_dir=store: the data sets go to the object store storage.uri names"),
])
def test_stop_and_tracking_settings_are_checked(override, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        load_config(None, [override])


def test_missing_config_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("configs/nope.yaml")


def test_overrides_are_typed_and_checked(tmp_path):
    config = load_config(None, ["training.max_steps=40", "training.learning_rate=1e-3", "parallel.recompute=true"])
    assert (config.training.max_steps, config.training.learning_rate, config.parallel.recompute) == (40, 1e-3, True)
    with pytest.raises(ConfigError, match="unknown key training.steps"):
        load_config(None, ["training.steps=4"])
    with pytest.raises(ConfigError, match="expected section.key=value"):
        load_config(None, ["training.max_steps"])


def test_resolved_config_round_trips(tmp_path):
    config = load_config(DEFAULT_CONFIG, ["training.max_steps=17"])
    again = load_config(write(tmp_path, config.to_yaml()))
    assert again == config
    assert again.flat()["training.max_steps"] == 17


LAYOUT_ERRORS = [
    (["parallel.tensor=3", "model.num_attention_heads=4"], "must be divisible by parallel.tensor"),
    (["parallel.pipeline=3"], "model.num_layers (4) must be divisible"),
    (["parallel.data=2"], "training.global_batch_size (8) must equal"),
    (["parallel.sharding_stage=2", "parallel.sharding_degree=2", "parallel.micro_batch_size=8"], "needs GPUs"),
    (["parallel.sharding_stage=1"], "sharding_degree: must be 1 when"),
    (["parallel.amp_dtype=fp8"], "parallel.amp_dtype"),
    (["parallel.device=tpu"], "parallel.device"),
]


@pytest.mark.parametrize("overrides, message", LAYOUT_ERRORS)
def test_invalid_layouts(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(REPO_ROOT / "configs" / "tiny-small.yaml", overrides)
    assert message in str(err.value)


def test_layout_coordinates_follow_fleet_order():
    config = load_config(None, ["parallel.data=2", "parallel.tensor=2", "parallel.pipeline=2",
                                "parallel.micro_batch_size=2", "parallel.accumulation_steps=4"])
    layout = config.layout()
    assert layout.world_size == 8 and layout.global_batch_size == 16
    # model axis fastest, then sharding, pipe, data
    assert layout.coordinates(0) == {"data": 0, "pipe": 0, "sharding": 0, "model": 0}
    assert layout.coordinates(1) == {"data": 0, "pipe": 0, "sharding": 0, "model": 1}
    assert layout.coordinates(2) == {"data": 0, "pipe": 1, "sharding": 0, "model": 0}
    assert layout.coordinates(5) == {"data": 1, "pipe": 0, "sharding": 0, "model": 1}
    assert layout.bubble_fraction == pytest.approx(1 / 5)
    assert layout.name == "dp2-tp2-pp2"


def test_amp_on_cpu_is_accepted_but_inactive():
    layout = load_config(None, ["parallel.amp_dtype=bfloat16"]).layout()
    assert not layout.amp_effective and layout.as_params()["amp_effective"] == "false"
    gpu = load_config(None, ["parallel.amp_dtype=bfloat16", "parallel.device=gpu"]).layout()
    assert gpu.amp_effective


def test_512_gpu_layout_validates_and_describes():
    config = load_config(REPO_ROOT / "configs" / "llama-100b-512gpu.yaml")
    layout = config.layout()
    assert (layout.tp, layout.pp, layout.dp, layout.world_size) == (8, 16, 4, 512)
    text = layout.describe()
    assert "world size 512" in text and "pipeline stage 15" in text
    assert sum(line.startswith("rank ") for line in text.splitlines()) == 512
    assert "rank  511 (node 63): dp 3 pp 15 sharding 0 tp 7" in text
    from core.arithmetic import parameters as estimate_parameters

    assert 95e9 < estimate_parameters(config.model, config.tokenizer) < 105e9


def test_too_many_processes_for_this_machine(monkeypatch):
    """CPU: at most 2 processes per core (the machine's core count is pinned so the test means the same anywhere)."""
    monkeypatch.setattr("core.workarounds.cpu_runtime.available_cores", lambda: 2)
    fits = load_config(None, ["parallel.data=4", "parallel.micro_batch_size=4"])
    fits.layout().check_fits_machine()
    config = load_config(None, ["parallel.data=8", "parallel.micro_batch_size=2"])
    with pytest.raises(ConfigError, match="needs 8 processes on this node but only 4 CPU processes"):
        config.layout().check_fits_machine()


@pytest.mark.parametrize("overrides, message", [
    (["serving.generation=beam"], "serving.generation: 'beam' is not allowed"),
    (["serving.scheduler=fifo"], "serving.scheduler: 'fifo' is not allowed"),
    (["serving.max_batch_size=0"], "serving.max_batch_size: must be > 0"),
    (["serving.max_queue=-2"], "serving.max_queue: must be >= 0, or -1"),
    (["serving.request_timeout_s=0"], "serving.request_timeout_s: must be > 0"),
    (["serving.api_port=18180"], "must all differ"),
    (["serving.metrics_port=80"], "serving.metrics_port: must be a port in 1024..65535"),
])
def test_invalid_serving_settings(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(DEFAULT_CONFIG, overrides)


def test_serving_workers_threads_and_paddle_serving_threads(monkeypatch):
    """Workers follow the cores (one per core, one math thread each by default); Paddle Serving gets one thread per
    request in flight (+4), thread Ops and no auto-batching of its own (the workers batch)."""
    from serving.server.sizes import capacity, predictor_threads, render_config, workers

    monkeypatch.setattr("core.workarounds.cpu_runtime.available_cores", lambda: 8)
    config = load_config(DEFAULT_CONFIG)
    assert (workers(config.serving), predictor_threads(config.serving)) == (8, 1)
    config = load_config(DEFAULT_CONFIG, ["serving.workers=2", "serving.predictor_threads=0", "serving.max_queue=4",
                                          "serving.max_batch_size=8"])
    assert (workers(config.serving), predictor_threads(config.serving), capacity(config.serving)) == (2, 4, 24)
    default = load_config(DEFAULT_CONFIG, ["serving.workers=3"])  # (max_queue -1: at least 128 in flight)
    # (8 workers: the batch of 32 alone passes 128, no queue)
    assert capacity(default.serving) == 3 * 43 and capacity(load_config(DEFAULT_CONFIG).serving) == 8 * 32
    rendered = render_config(config)
    op = rendered["op"]["generate"]
    assert rendered["dag"]["is_thread_op"] is True and op["concurrency"] == rendered["worker_num"] == 28
    assert (op["batch_size"], op["auto_batching_timeout"]) == (1, -1)


def test_a_run_config_of_an_earlier_version_reads_as_todays(tmp_path):
    """model.rope_scaling_factor (earlier run configs) is read as model.rope_scaling: a factor of 2 a linear
    scaling, 1 none; the run's config can still be exported."""
    for factor, expected in ((2.0, {"rope_type": "linear", "factor": 2.0}), (1.0, {})):
        path = tmp_path / f"run{factor}.yaml"
        path.write_text(f"model:\n  rope_scaling_factor: {factor}\n")
        assert load_config(path).model.rope_scaling == expected
