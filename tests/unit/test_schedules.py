"""Pipeline schedules (core/schedules.py), stage splits and their validation (core/layout.py), the advice."""
from __future__ import annotations

import pytest

from core import schedules
from core.config import load_config
from core.errors import ConfigError
from core.layout import ParallelLayout, balanced_split
from core.schedules import Op

PP2 = "configs/tiny-pp2.yaml"


def order(text: str) -> list[Op]:
    return [Op(t[0].lower(), int(t[1:].split(".")[0]), int(t.split(".")[1]) if "." in t else 0) for t in text.split()]


def test_1f1b_orders_warm_up_then_alternate():
    assert schedules.stage_order("1F1B", 2, 4, 1, 0) == order("F0 F1 B0 F2 B1 F3 B2 B3")
    assert schedules.stage_order("1F1B", 2, 4, 1, 1) == order("F0 B0 F1 B1 F2 B2 F3 B3")
    assert schedules.stage_order("1F1B", 4, 2, 1, 0) == order("F0 F1 B0 B1")  # warm-up capped at m


def test_interleaved_order_is_the_one_paddle_printed():
    # Recorded from a pp2 x 2-virtual-stage run (PipelineParallelWithInterleave.get_static_scheduler(), stage 0).
    paddle = ("f0_vp0;f1_vp0;f0_vp1;f1_vp1;f2_vp0;b0_vp1;f3_vp0;b1_vp1;f2_vp1;b0_vp0;f3_vp1;b1_vp0;b2_vp1;b3_vp1;"
              "b2_vp0;b3_vp0;")
    assert schedules.parse_paddle_order(paddle) == schedules.stage_order("interleaved-1F1B", 2, 4, 2, 0)
    assert schedules.parse_paddle_order("f0;f1;b0;") == order("F0 F1 B0")


@pytest.mark.parametrize("name,p,m,v", [("1F1B", 2, 4, 1), ("1F1B", 4, 8, 1), ("1F1B", 16, 32, 1),
                                        ("interleaved-1F1B", 2, 4, 2), ("interleaved-1F1B", 4, 8, 2),
                                        ("interleaved-1F1B", 4, 16, 4), ("FThenB", 4, 6, 2)])
def test_simulated_idle_equals_the_analytic_bubble(name, p, m, v):
    events = schedules.timeline(name, p, m, v)
    assert schedules.idle_fraction(events) == pytest.approx(schedules.analytic_bubble(name, p, m, v))
    assert len(events) == 2 * p * m * (v if name != "1F1B" else 1)


def test_bubble_formulas_by_hand():
    assert schedules.analytic_bubble("1F1B", 2, 4) == pytest.approx(1 / 5)
    assert schedules.analytic_bubble("interleaved-1F1B", 16, 32, 2) == pytest.approx(15 / 79)
    assert schedules.analytic_bubble("1F1B", 1, 4) == 0


def test_peak_activations_grow_from_1f1b_to_f_then_b():
    lines = schedules.compare_text(4, 8, 2).splitlines()[1:]
    held = {line.split()[0]: float(line.split()[-1]) for line in lines}
    assert held == {"1F1B": 4.0, "interleaved-1F1B": 5.5, "FThenB": 8.0}


def test_an_order_that_cannot_run_is_reported():
    with pytest.raises(ValueError, match="deadlock"):  # stage 0 waits for a backward that needs its own forward
        schedules.simulate([order("B0 F0"), order("F0 B0")], 1)


def test_measured_times_stretch_the_slow_stage():
    orders = [schedules.stage_order("1F1B", 2, 4, 1, s) for s in range(2)]
    even = schedules.simulate(orders, 1, [1, 1], [2, 2])
    slow = schedules.simulate(orders, 1, [1, 2], [2, 4])
    assert max(e.end for e in slow) > max(e.end for e in even)
    assert schedules.idle_fraction(slow) > schedules.idle_fraction(even)


def test_render_text_marks_idle_and_order():
    text = schedules.render_text(schedules.timeline("1F1B", 2, 2, 1))
    # stage 1 runs F0 [1,2) B0 [2,4) F1 [4,5) B1 [5,7); stage 0 waits for each of its backwards
    assert text.splitlines()[0] == "stage  0 |FF..BB.BB|"
    assert "order: F0 B0 F1 B1" in text


def layout(*overrides: str, config: str = PP2) -> ParallelLayout:
    return load_config(config, list(overrides)).layout()


def test_stage_split_from_list_uniform_and_parameters():
    assert layout("parallel.stage_layers=[3,1]").stage_split == (3, 1)
    assert layout("parallel.stage_layers=[3,1]").stage_boundaries() == [0, 4, 7]  # [emb, 4 layers, norm, head]
    assert layout().stage_boundaries() == [0, 3, 7]
    assert layout("parallel.stage_layers=[0,4]").stage_layers(1) == range(0, 4)
    # by parameters, 8 layers over 4 stages: the 8000 x 128 embedding (1.02M) outweighs five 197k-parameter layers
    split = layout("parallel.pipeline=4", "parallel.accumulation_steps=2", "parallel.micro_batch_size=4",
                   "model.num_layers=8", "parallel.stage_layers=parameters").stage_split
    assert split == (0, 4, 4, 0)


def test_balanced_split_by_hand():
    assert balanced_split([1, 1, 1, 1], 2) == (2, 2)
    assert balanced_split([1, 1, 1, 1], 2, first=2) == (1, 3)
    assert balanced_split([1] * 6, 3, first=1, last=1) == (1, 3, 2)  # costs 2, 3, 3: slowest 3, squares 22
    assert balanced_split([1] * 6, 3, first=0.5, last=0.5) == (2, 2, 2)
    assert balanced_split([5, 1, 1, 1], 2) == (1, 3)


@pytest.mark.parametrize("overrides,message", [
    (["parallel.schedule=interleaved"], "parallel.schedule: 'interleaved' is not allowed"),
    (["parallel.virtual_stages=2"], "1F1B schedule runs one model chunk"),
    (["parallel.schedule=interleaved-1F1B"], "needs >= 2 model chunks"),
    (["parallel.schedule=interleaved-1F1B", "parallel.virtual_stages=2", "parallel.accumulation_steps=2",
      "parallel.micro_batch_size=4"], "at least 2 x 2 = 4 micro-batches"),
    (["parallel.schedule=interleaved-1F1B", "parallel.virtual_stages=4"], "divide into parallel.pipeline x"),
    (["parallel.schedule=interleaved-1F1B", "parallel.virtual_stages=2", "parallel.device=gpu"],
     "needs parallel.pipeline > 2 on GPU"),
    (["parallel.schedule=FThenB", "parallel.virtual_stages=2"], "FThenB"),
    (["parallel.schedule=interleaved-1F1B", "parallel.virtual_stages=2", "parallel.stage_layers=[3,1]"],
     "uneven split [3, 1] needs parallel.schedule=1F1B"),
    (["parallel.stage_layers=[3,2]"], "add up to model.num_layers (4)"),
    (["parallel.stage_layers=[4]"], "must list 2 counts"),
    (["parallel.stage_layers=even"], "'even' is not allowed"),
    (["model.num_layers=5"], "parallel.stage_layers=[3, 1]"),
])
def test_invalid_schedules_are_refused_before_launch(overrides, message):
    with pytest.raises(ConfigError) as err:
        layout(*overrides)
    assert message in str(err.value)


def test_schedule_needs_a_pipeline():
    with pytest.raises(ConfigError, match="needs parallel.pipeline >= 2"):
        layout("parallel.schedule=interleaved-1F1B", "parallel.virtual_stages=2", config="configs/tiny-small.yaml")


def test_interleaved_layout_names_and_params():
    lay = layout("parallel.schedule=interleaved-1F1B", "parallel.virtual_stages=2")
    assert lay.name == "pp2v2" and lay.bubble_fraction == pytest.approx(1 / 9)
    assert lay.as_params()["schedule"] == "interleaved-1F1B" and lay.as_params()["virtual_stages"] == 2
    assert "decoder layers 0..0 and 2..2" in lay.describe()
