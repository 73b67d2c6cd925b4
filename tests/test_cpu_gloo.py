"""The CPU gloo compatibility layer: refuses other Paddle versions; its collectives compute the right values."""
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from training import cpu_gloo


def test_refuses_other_paddle_versions():
    with pytest.raises(cpu_gloo.UnsupportedPaddleVersion, match="paddlepaddle 2.6.2, but paddle 3.0.0"):
        cpu_gloo.check_version("3.0.0")
    cpu_gloo.check_version("2.6.2")


def _two_ranks(out_dir):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import pipeline  # noqa: F401

    import paddle
    import paddle.distributed as dist
    from paddle.distributed.fleet.layers.mpu import mp_ops

    from training import cpu_gloo

    applied = cpu_gloo.apply(timeout_s=60)
    dist.init_parallel_env()
    rank = dist.get_rank()
    group = dist.new_group([0, 1])  # a gloo sub-group: patch 6 gives it its own store
    x = paddle.to_tensor(np.arange(4, dtype="float32") + 10 * rank, stop_gradient=False)
    # patch 2: the NCCL-only calc-stream API, on gloo
    summed = x.detach().clone()
    group.process_group.all_reduce_on_calc_stream(summed, paddle.base.core.ReduceOp.SUM)
    # patch 3: c_concat (all_gather along the last axis, backward = own slice), c_split, c_identity
    full = mp_ops._c_concat(x, group=group)
    (full * paddle.arange(8, dtype="float32")).sum().backward()
    part = mp_ops._c_split(paddle.arange(8, dtype="float32"), group=group)
    same = mp_ops._c_identity(x, group=group)
    np.savez(os.path.join(out_dir, f"rank{rank}.npz"), summed=summed.numpy(), full=full.numpy(), grad=x.grad.numpy(),
             part=part.numpy(), same=same.numpy(), applied=np.array(applied))


def test_collectives_on_two_gloo_processes(tmp_path):
    import paddle.distributed as dist

    dist.spawn(_two_ranks, args=(str(tmp_path),), nprocs=2, backend="gloo")
    r0, r1 = (np.load(tmp_path / f"rank{r}.npz") for r in (0, 1))
    base = np.arange(4, dtype="float32")
    for r, res in enumerate((r0, r1)):
        assert len(res["applied"]) == 6
        np.testing.assert_array_equal(res["summed"], 2 * base + 10)
        np.testing.assert_array_equal(res["full"], np.concatenate([base, base + 10]))
        np.testing.assert_array_equal(res["grad"], np.arange(8, dtype="float32")[4 * r: 4 * r + 4])
        np.testing.assert_array_equal(res["part"], np.arange(8, dtype="float32")[4 * r: 4 * r + 4])
        np.testing.assert_array_equal(res["same"], base + 10 * r)
