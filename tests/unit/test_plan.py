"""`make plan`'s memory and step-time model against hand-computed cases, and the 100B example (fast, no GPU)."""
import pytest

from core import REPO_ROOT, arithmetic
from core.config import load_config
from pipeline import plan

# hidden 1024, 4 layers, 8 heads (= KV heads), intermediate 4096, vocabulary 1000, 128-token sequences.
# N = 4 x (attention 2*1024^2 + 2*1024*1024 + MLP 3*1024*4096 + norms 2*1024) + embedding and head 2*1000*1024
#     + final norm 1024 = 4 x 16,779,264 + 2,048,000 + 1,024 = 69,166,080
# FLOPs per token: 6 x (N - the input embedding 1000*1024) + 12 L h s = 6 x 68,142,080 + 12*4*1024*128
FLOPS = 6 * 68_142_080 + 6_291_456
SMALL = ["model.hidden_size=1024", "model.intermediate_size=4096", "model.num_layers=4",
         "model.num_attention_heads=8", "model.num_key_value_heads=8", "model.max_position_embeddings=128",
         "tokenizer.max_vocab_size=1000", "training.seq_length=128", "training.global_batch_size=16",
         "parallel.device=gpu", "parallel.amp_dtype=bfloat16", "parallel.amp_level=O2"]


def tp2_pp2(config, recompute=False):
    """dp2 x tp2 x pp2, micro-batches of 2 x 4 per step: a ParallelLayout of `config`'s model, as the plan builds it."""
    return plan.candidate(config, dp=2, tp=2, pp=2, sharding_stage=0, sharding_degree=1, micro_batch_size=2,
                          accumulation_steps=4, recompute=recompute)


def test_memory_by_hand():
    config = load_config(None, SMALL)
    mem = plan.memory(config, tp2_pp2(config))
    n = 69_166_080 / 4  # per tensor x pipeline rank: 17,291,520
    assert mem["parameters"] == mem["gradients"] == n * 2  # bf16: 34,583,040 bytes
    assert mem["optimizer"] == n * 12  # two fp32 moments + fp32 master weights (O2): 207,498,240
    # s*b*h*(10 + 24/tp + 5*a*s/(h*tp)) = 128*2*1024*(10 + 12 + 2.5) = 6,422,528 per layer, 2 layers, 2 in flight
    assert mem["activations"] == 6_422_528 * 2 * 2
    assert mem["logits"] == 2 * 128 * 2 * 1000 * 4 / 2  # fp32 logits + the softmax the loss keeps, split over tp
    assert mem["total"] == pytest.approx(303_378_432)


def test_recompute_and_sharding_by_hand():
    config = load_config(None, SMALL)
    recompute = plan.memory(config, tp2_pp2(config, recompute=True))
    # layer inputs (2 layers x 2 in flight) + one layer's full set while it is recomputed, less its input (kept)
    assert recompute["activations"] == 2 * 128 * 2 * 1024 * 2 * 2 + 6_422_528 - 2 * 128 * 2 * 1024
    n = 69_166_080 / 4
    for stage, (params, grads, optimizer) in {1: (n * 2, n * 2, n * 12 / 2), 2: (n * 2, n, n * 12 / 2),
                                              3: (n, n, n * 12 / 2)}.items():
        mem = plan.memory(config, plan.candidate(config, 1, 2, 2, stage, 2, 2, 4, False))
        assert (mem["parameters"], mem["gradients"], mem["optimizer"]) == (params, grads, optimizer), stage


def test_step_time_by_hand():
    """8 GPUs in one node, data parallel only, fp32: compute (6 N' + 12 L h s) T / (8 x peak x utilisation) and one
    ring all-reduce of the fp32 gradients over NVLink."""
    config = load_config(None, [o for o in SMALL if "amp" not in o] + [
        "cluster.gpus=8", "cluster.peak_tflops=100", "cluster.utilisation=0.5", "cluster.intra_node_gbps=100"])
    t = plan.step_time(config, plan.candidate(config, 8, 1, 1, 0, 1, 2, 1, False))
    tokens = 16 * 128
    assert t["compute_s"] == pytest.approx(FLOPS * tokens / (8 * 100e12 * 0.5))
    assert t["data_s"] == pytest.approx(2 * 7 / 8 * 69_166_080 * 4 / 100e9)
    assert t["tensor_s"] == t["pipeline_s"] == t["bubble"] == 0


def test_the_100b_example(tmp_path):
    from core import REPO_ROOT
    from core.layout import ParallelLayout

    config = load_config(REPO_ROOT / "configs" / "llama-100b-512gpu.yaml", ["cluster.gpus=512"])
    dp_only = plan.memory(config, plan.candidate(config, 512, 1, 1, 0, 1, 1, 2, False))
    assert dp_only["parameters"] / 1e9 == pytest.approx(199.3, abs=0.1)  # 99.6B x 2 bytes: no single GPU holds it
    rows = plan.rank(config, plan.enumerate_layouts(config))
    assert all(r["parallel"].tp <= 8 for r in rows)  # tensor groups stay inside a node
    fitting = [r["layout"] for r in rows if r["fits"]]
    assert plan.label(config.layout()) in fitting  # tp8 x pp16 x dp4 fits (20.7 GB of 72)
    assert not any(r["fits"] for r in rows if r["parallel"].tp * r["parallel"].pp == 1 and
                   r["parallel"].sharding_stage == 0)
    assert [r["step_s"] for r in rows if r["fits"]] == sorted(r["step_s"] for r in rows if r["fits"])
    assert plan.run(config, top=3, csv_path=str(tmp_path / "plan.csv"), write=str(tmp_path / "chosen.yaml")) == 0
    written = load_config(tmp_path / "chosen.yaml")
    assert written.layout().world_size == 512 and written.parallel.nnodes == 64
    assert len((tmp_path / "plan.csv").read_text().splitlines()) == len(rows) + 1


# unit = s*b*h 2-byte values of one micro-batch = 128 * 2 * 1024 bytes (bf16); the config's layout is tp2_pp2
UNIT = 128 * 2 * 1024
LAYOUT = ["parallel.data=2", "parallel.tensor=2", "parallel.pipeline=2", "parallel.micro_batch_size=2",
          "parallel.accumulation_steps=4"]


@pytest.mark.parametrize("overrides, per_layer", [
    ([], 24.5),  # 10 + 24/2 + 5*8*128/(1024*2)
    (["performance.flash_attention=true"], 22.0),  # no scores
    (["performance.sequence_parallel=true"], 19.5),  # 34/2 + 2.5 (Korthikanti Table 2, sequence parallel)
    (["performance.sequence_parallel=true", "performance.flash_attention=true"], 17.0),
])
def test_activations_with_flash_attention_and_sequence_parallelism_by_hand(overrides, per_layer):
    config = load_config(None, SMALL + LAYOUT + overrides)
    assert plan.memory(config, tp2_pp2(config))["activations"] == per_layer * UNIT * 2 * 2  # 2 layers, 2 in flight


@pytest.mark.parametrize("overrides, activations", [
    (["performance.recompute_granularity=full"], 2 * 4 + 22.5),  # inputs kept + one layer's rest
    (["performance.recompute_granularity=core_attn"], 22 * 4 + 2.5),  # all but the scores + one layer's scores
    (["performance.recompute_granularity=full_attn"], 15 * 4 + 9.5),  # norms + MLP; one layer's attention
    (["performance.recompute_granularity=full", "performance.pp_recompute_interval=2"], (2 + 24.5) * 2 + 22.5),
    (["performance.recompute_granularity=full", "performance.sequence_parallel=true"], 1 * 4 + 18.5),
])
def test_recompute_granularity_by_hand(overrides, activations):
    config = load_config(None, SMALL + LAYOUT + ["parallel.recompute=true", *overrides])
    c = tp2_pp2(config, recompute=True)
    assert plan.memory(config, c)["activations"] == activations * UNIT


def test_recompute_flops_and_overlap_by_hand():
    scores = 4 * 4 * 128 * 1024  # 4 L s h per token
    expected = {"full": 2 * 69_166_080, "full_attn": 2 * 4 * (2 * 1024 ** 2 + 2 * 1024 * 1024) + scores,
                "core_attn": scores}
    for granularity, flops in expected.items():
        config = load_config(None, SMALL + ["parallel.recompute=true",
                                            f"performance.recompute_granularity={granularity}"])
        c = tp2_pp2(config, recompute=True)
        assert arithmetic.recompute_flops_per_token(config, c) == flops
        base = plan.step_time(config, tp2_pp2(config))
        assert plan.step_time(config, c)["compute_s"] == pytest.approx(base["compute_s"] * (FLOPS + flops) / FLOPS)
    config = load_config(None, SMALL)
    plain = plan.step_time(config, tp2_pp2(config))
    config = load_config(None, SMALL + LAYOUT + ["performance.mp_async_allreduce=true", "performance.dp_comm_overlap=true"])
    overlapped = plan.step_time(config, tp2_pp2(config))
    assert overlapped["tensor_s"] == pytest.approx(plain["tensor_s"] / 2)
    assert overlapped["data_s"] == pytest.approx(max(0.0, plain["data_s"] - plain["compute_s"] * 2 / 3))
    assert overlapped["compute_s"] == plain["compute_s"]


def test_the_100b_plan_shows_flash_attention_and_sequence_parallelism_side_by_side(capsys):
    from core import REPO_ROOT
    config = load_config(REPO_ROOT / "configs" / "llama-100b-512gpu.yaml", ["cluster.gpus=512"])
    assert config.performance.flash_attention and config.performance.sequence_parallel
    variants = dict(plan.performance_variants(config, config.layout()))
    assert list(variants) == ["as configured", "without flash attention", "without sequence parallelism",
                              "without either"]
    act = {k: v["activations"] for k, v in variants.items()}
    assert act["as configured"] < act["without flash attention"] < act["without either"]
    assert act["as configured"] < act["without sequence parallelism"] < act["without either"]
    plan.run(config, top=1)
    out = capsys.readouterr().out
    assert "without flash attention" in out and "without sequence parallelism" in out


@pytest.mark.parametrize("path", sorted((REPO_ROOT / "configs").glob("*.yaml")), ids=lambda p: p.stem)
def test_plan_and_a_dry_run_work_on_every_shipped_config(path, capsys):
    """`make plan` and `make train DRY_RUN=1` on each config in configs/: some layout fits the config's own cluster
    (the 512-GPU configs carry theirs), and the dry run prints the layout without launching."""
    from core.config import load_config
    from pipeline import plan
    from training.launch import train_run as train

    config = load_config(path)
    assert plan.run(config, 3, "", "") == 0
    out = capsys.readouterr().out
    assert " fit; " in out and " 0 fit" not in out
    assert train.run(config, dry_run=True) == 0
    layout = config.layout()
    assert f"layout {layout.name}: world size {layout.world_size} = " in capsys.readouterr().out
