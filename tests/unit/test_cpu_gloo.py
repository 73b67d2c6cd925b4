"""The CPU gloo compatibility layer: refuses other Paddle versions; its collectives compute the right values."""
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from core.workarounds import cpu_gloo
def test_refuses_other_paddle_versions():
    with pytest.raises(cpu_gloo.UnsupportedPaddleVersion, match="paddlepaddle 2.6.2, but paddle 3.0.0"):
        cpu_gloo.check_version("3.0.0")
    cpu_gloo.check_version("2.6.2")


def _two_ranks(out_dir):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository (a spawned process)
    import core  # noqa: F401

    import paddle
    import paddle.distributed as dist
    from paddle.distributed.fleet.layers.mpu import mp_ops

    from core.workarounds import cpu_gloo
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
    saved = dict(os.environ)  # (paddle sets OMP_NUM_THREADS and CUSTOM_DEVICE_ROOT here: not for later tests)
    try:
        import paddle.distributed as dist

        dist.spawn(_two_ranks, args=(str(tmp_path),), nprocs=2, backend="gloo")
    finally:
        os.environ.clear()
        os.environ.update(saved)
    r0, r1 = (np.load(tmp_path / f"rank{r}.npz") for r in (0, 1))
    base = np.arange(4, dtype="float32")
    for r, res in enumerate((r0, r1)):
        assert len(res["applied"]) == 7
        np.testing.assert_array_equal(res["summed"], 2 * base + 10)
        np.testing.assert_array_equal(res["full"], np.concatenate([base, base + 10]))
        np.testing.assert_array_equal(res["grad"], np.arange(8, dtype="float32")[4 * r: 4 * r + 4])
        np.testing.assert_array_equal(res["part"], np.arange(8, dtype="float32")[4 * r: 4 * r + 4])
        np.testing.assert_array_equal(res["same"], base + 10 * r)


class _Ring:
    """A fake pipeline group: records the order in which a rank's blocking sends/receives would run."""

    def __init__(self, rank, nranks, log):
        self.rank, self.nranks, self.log = rank, nranks, log
        self.process_group = self

    def get_group_rank(self, peer):
        return peer

    def send(self, tensor, peer, sync):
        self.log.append(("send", peer, tensor))
        return self

    def recv(self, tensor, peer, sync):
        self.log.append(("recv", peer, tensor))
        return self

    def wait(self):
        return None


def _ops(rank, nranks, log):
    from types import SimpleNamespace

    from paddle.distributed.fleet.meta_parallel.pp_utils import p2p_communication as p2p

    group = _Ring(rank, nranks, log)
    prev, nxt = (rank - 1) % nranks, (rank + 1) % nranks
    op = lambda kind, peer, what: SimpleNamespace(op=kind, peer=peer, group=group, tensor=what)  # noqa: E731
    # Paddle's sync-send list order: recv_prev, send_next, recv_next, send_prev
    return [op(p2p._recv_on_calc_stream, prev, "recv_prev"), op(p2p._send_on_calc_stream, nxt, "send_next"),
            op(p2p._recv_on_calc_stream, nxt, "recv_next"), op(p2p._send_on_calc_stream, prev, "send_prev")]


@pytest.mark.parametrize("nranks", [2, 3, 4])
def test_ring_exchange_order_cannot_wait_in_a_cycle(nranks):
    """Every rank sends to its next stage and receives from its previous one (the interleaved schedule's ring).
    With blocking gloo sends, the ranks finish only if no cycle of ranks waits on each other: pair by pair, lower
    rank sending first, and between two ranks the messages pair up in order (activation before gradient)."""
    logs = {r: [] for r in range(nranks)}
    for r in range(nranks):
        cpu_gloo._batch_send_recv_blocking(_ops(r, nranks, logs[r]))
    order = {r: [(kind, peer) for kind, peer, _ in logs[r]] for r in logs}
    if nranks == 2:
        assert order[0] == [("send", 1), ("send", 1), ("recv", 1), ("recv", 1)]
        assert order[1] == [("recv", 0), ("recv", 0), ("send", 0), ("send", 0)]
    else:
        assert order[0] == [("send", 1), ("recv", 1), ("send", nranks - 1), ("recv", nranks - 1)]
        assert order[1] == [("recv", 0), ("send", 0), ("send", 2), ("recv", 2)]
    # Replay: a blocking op completes only when its peer's matching op is at the head of the peer's queue.
    queues = {r: list(logs[r]) for r in range(nranks)}
    while any(queues.values()):
        progressed = False
        for r in range(nranks):
            if not queues[r]:
                continue
            kind, peer, what = queues[r][0]
            want = "recv" if kind == "send" else "send"
            head = queues[peer][0] if queues[peer] else None
            if head and head[0] == want and head[1] == r:
                sent = what if kind == "send" else head[2]
                got = head[2] if kind == "send" else what
                # a forward activation lands in recv_prev, a gradient in recv_next
                assert (sent, got) in {("send_next", "recv_prev"), ("send_prev", "recv_next")}, (r, peer, sent, got)
                queues[r].pop(0)
                queues[peer].pop(0)
                progressed = True
        assert progressed, f"deadlock: {queues}"
