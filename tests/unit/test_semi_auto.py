"""Semi-automatic mode: weight placements, what the config refuses, and the refused resume (fast, no processes).
The training itself is compared with single-process losses in tests/integration/test_parallel.py (dp2, tp2, dp2 x tp2)."""
import json

import pytest

from training.launch import train_run as train
from core.config import load_config
from core.errors import ConfigError
from training import semi_auto
@pytest.mark.parametrize("layer,param,expected", [
    ("llama.layers.0.self_attn.q_proj", "weight", ("R", "S1")),  # column parallel: [in, out] split on out
    ("llama.layers.0.self_attn.q_proj", "bias", ("R", "S0")),
    ("llama.layers.3.mlp.up_proj", "weight", ("R", "S1")),
    ("llama.layers.0.self_attn.o_proj", "weight", ("R", "S0")),  # row parallel: split on in
    ("llama.layers.0.mlp.down_proj", "bias", ("R", "R")),
    ("llama.embed_tokens", "weight", ("R", "S1")),
    ("lm_head", "weight", ("R", "S1")),
    ("llama.layers.0.input_layernorm", "weight", ("R", "R")),
    ("llama.norm", "weight", ("R", "R")),
])
def test_placements(layer, param, expected):
    assert semi_auto.placements(layer, param) == expected


def test_semi_auto_layouts_and_refusals():
    layout = load_config("configs/tiny-dp2tp2.yaml", ["parallel.mode=semi_auto"]).layout()
    assert layout.name == "dp2-tp2-semi-auto" and layout.as_params()["mode"] == "semi_auto"
    with pytest.raises(ConfigError, match="pipeline or sharding, which need parallel.mode=manual"):
        load_config("configs/tiny-pp2.yaml", ["parallel.mode=semi_auto"])
    with pytest.raises(ConfigError, match="'auto' is not allowed"):
        load_config("configs/tiny-tp2.yaml", ["parallel.mode=auto"])


def test_resume_of_a_semi_auto_run_is_refused_before_launch(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "checkpoint-3").mkdir(parents=True)
    (run_dir / "checkpoints" / "checkpoint-3" / "checkpoint_complete.json").write_text(json.dumps({"step": 3}))
    config = load_config("configs/tiny-tp2.yaml", ["parallel.mode=semi_auto"])
    (run_dir / "config.yaml").write_text(config.to_yaml())
    with pytest.raises(ConfigError, match="cannot resume.*model.init_from=.*checkpoint-3"):
        train.resumed_config(str(run_dir), [])
