"""CPU (gloo) compatibility layer for Paddle fleet hybrid parallel -- written for paddlepaddle 2.6.2 only.

Why this exists: fleet's tensor and pipeline parallel in Paddle 2.6.2 assume NCCL/GPU in six places. No maintained
library fixes them, so each patch below replaces exactly one such spot with the equivalent gloo call, numbered as in
the list of blockers (see docs/training.md "Hybrid parallel on CPU"):

  1. tensor-parallel input broadcast (`broadcast_input_data`) asserts the place is gpu/xpu/custom;
  2. `ProcessGroupGloo` lacks the `*_on_calc_stream` methods fleet calls (NCCL-only API);
  3. `c_identity`, `c_split` and `c_concat` have no CPU kernels (c_softmax_with_cross_entropy neither: the model is
     built with `tensor_parallel_output=False` on CPU instead, see model/llama.py);
  4. `ParallelEnv._device_id` is only set for gpu/xpu, and `PipelineLayer` reads it;
  5. pipeline send/recv: gloo sends block until the peer receives, so the batched "on calc stream" p2p must run as
     blocking calls in an order that cannot wait in a cycle (pair by pair: the interleaved schedule's ring);
  6. every gloo sub-group runs its connect handshake under the same keys of the one global TCPStore, so with 4+
     processes groups read each other's stale addresses (TIMEOUT / connection refused): each gloo sub-group gets its
     own TCPStore, hosted by the group's rank 0 and advertised through the global store;
  7. the interleaved pipeline engine asserts more than two stages (see `_interleave_sanity`);
  8. at the end of a run, a rank that exits closes its gloo connections while its peers are still leaving, and a
     peer's gloo threads (or its interpreter's destructors of the groups) then abort the process (SIGABRT, exit -6,
     after "Training completed"; seen once in ~15 4-rank runs here): `end_process()` waits for every rank at a
     barrier and leaves without the interpreter's teardown, as soon as the rank's own work is flushed.

`apply()` is called once per process, only when training on CPU with more than one process; it refuses to run on
any other Paddle version, because each patch depends on private internals of 2.6.2.
"""
from __future__ import annotations

import os
import socket
import logging
import sys

SUPPORTED_PADDLE = "2.6.2"
APPLIED: list[str] = []


class UnsupportedPaddleVersion(RuntimeError):
    pass


def end_process() -> None:
    """The rank's last call on a multi-process CPU run (8): a barrier, stdout/stderr/logging flushed, exit 0 without
    destructors. Only after everything the rank owns is on disk (checkpoints drained, MLflow records flushed)."""
    import paddle.distributed as dist

    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(0)


def check_version(version: str) -> None:
    if version != SUPPORTED_PADDLE:
        raise UnsupportedPaddleVersion(
            f"core/workarounds/cpu_gloo.py patches private fleet internals of paddlepaddle {SUPPORTED_PADDLE}, but paddle "
            f"{version} is installed; install paddlepaddle=={SUPPORTED_PADDLE} (requirements/) or train on GPU")


# 1 ---------------------------------------------------------------------------------------------------------------------
def broadcast_input_data(hcg, *inputs, **kwargs):
    """fleet's version minus its device assertion: broadcast every tensor input within the tensor-parallel group."""
    import paddle
    from paddle.base import core
    from paddle.distributed.fleet.utils.hybrid_parallel_util import _broadcast_data_help, _broadcast_object_list_help

    def one(value):
        if isinstance(value, core.eager.Tensor):
            with paddle.no_grad():
                _broadcast_data_help(value, paddle.shape(value), value.dtype, hcg)
            return value
        return _broadcast_object_list_help(value, hcg)

    inputs = tuple(one(v) for v in inputs)
    kwargs = {k: one(v) for k, v in kwargs.items()}
    return inputs, kwargs


# 2 ---------------------------------------------------------------------------------------------------------------------
def _blocking(method_name):
    def call(self, *args):
        task = getattr(self, method_name)(*args, True)
        task.wait()
        return task

    call.__name__ = f"{method_name}_on_calc_stream"
    return call


# 3 ---------------------------------------------------------------------------------------------------------------------
class _LegacyOpsWithCpuCollectives:
    """Forwards to paddle's `_legacy_C_ops`, replacing the two mp ops that have no CPU kernel. Within one tensor-parallel
    group every rank holds the full input here (need_broadcast_data), so identity is a copy and split is a slice."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)

    @staticmethod
    def c_identity(x, *attrs):
        import paddle

        return paddle.assign(x)

    @staticmethod
    def c_split(x, *attrs):
        import paddle

        named = dict(zip(attrs[::2], attrs[1::2]))
        return paddle.split(x, named["nranks"], axis=-1)[named["rank"]].clone()


def _make_c_concat():
    import paddle
    import paddle.distributed as dist
    from paddle.autograd import PyLayer

    class ConcatOverGroup(PyLayer):
        """all_gather along the last axis; the gradient of each rank is its own slice."""

        @staticmethod
        def forward(ctx, x, group):
            ctx.rank, ctx.nranks = group.rank, group.nranks
            parts: list = []
            dist.all_gather(parts, x, group=group)
            return paddle.concat(parts, axis=-1)

        @staticmethod
        def backward(ctx, grad):
            return paddle.split(grad, ctx.nranks, axis=-1)[ctx.rank].clone()

    def c_concat(tensor, group=None):
        from paddle.distributed import collective

        if group is not None and not group.is_member():
            return None
        group = collective._get_default_group() if group is None else group
        return ConcatOverGroup.apply(tensor, group)

    return c_concat


# 5 ---------------------------------------------------------------------------------------------------------------------
def _batch_send_recv_blocking(p2p_ops):
    """The batch as blocking calls, ordered so that no set of ranks can wait on each other in a cycle.

    A gloo send returns only when its peer receives. In the interleaved schedule every stage exchanges with both
    neighbours at once, the last stage with the first (a ring), so Paddle's sync-send order (every rank receives
    from its previous stage first) would wait forever. Instead each rank works through its peers pair by pair, in
    the one global order of the pairs (lower rank, higher rank); within a pair the lower rank sends first and the
    higher rank receives first. The globally first pending pair is then at the head of both its ranks' queues, so
    the exchange always advances. Sends keep the list's order (send_next before send_prev) and so do receives
    (recv_prev before recv_next): with two stages, where the previous and next stage are the same rank, the
    activation and the gradient still arrive in the buffers meant for them."""
    from paddle.distributed.fleet.meta_parallel.pp_utils import p2p_communication as p2p

    if not p2p_ops:
        return
    me = p2p_ops[0].group.rank

    def key(item):
        index, op = item
        peer = op.group.get_group_rank(op.peer)
        sending = op.op is p2p._send_on_calc_stream
        first = sending if me < peer else not sending
        return (min(me, peer), max(me, peer), not first, index)

    for _, op in sorted(enumerate(p2p_ops), key=key):
        peer = op.group.get_group_rank(op.peer)
        if op.op is p2p._send_on_calc_stream:
            op.group.process_group.send(op.tensor, peer, True).wait()
        else:
            op.group.process_group.recv(op.tensor, peer, True).wait()


# 7 ---------------------------------------------------------------------------------------------------------------------
def _interleave_sanity(self):
    """`PipelineParallelWithInterleave._check_sanity` minus `num_stages > 2`: with two stages the ring's previous and
    next stage are the same rank, which the pair-ordered p2p (5) exchanges in order; the tests check pp2 x 2
    virtual stages against the single-process losses. The GPU path keeps Paddle's rule (core/layout.py)."""
    import paddle

    assert paddle.in_dynamic_mode(), "virtual pipeline stage with interleave only support eager dygraph mode"
    assert self.num_stages >= 2, "virtual pipeline needs pp degree >= 2"
    assert self.accumulate_steps % self.num_stages == 0, \
        "accumulate_steps should be evenly divisible by num_stages for pipeline with interleave"


# 6 ---------------------------------------------------------------------------------------------------------------------
def _own_store_per_gloo_group(original, timeout_s: int):
    from paddle.base import core

    stores = []  # the sub-group stores must outlive their process groups

    def new_process_group_impl(backend, store, rank, world_size, group_name, pg_options, group_id=0):
        if backend != "gloo" or group_id == 0:
            return original(backend, store, rank, world_size, group_name, pg_options, group_id=group_id)
        key = f"pipeline_gloo_group_store_{group_id}"
        if rank == 0:
            host = os.environ.get("PADDLE_CURRENT_ENDPOINT", "127.0.0.1:0").split(":")[0]
            with socket.socket() as probe:
                probe.bind((host, 0))
                port = probe.getsockname()[1]
            store.set(key, f"{host}:{port}".encode())
            sub_store = core.TCPStore(host, port, True, world_size, timeout_s)
        else:
            store.wait(key)
            host, port = bytes(store.get(key)).decode().split(":")
            sub_store = core.TCPStore(host, int(port), False, world_size, timeout_s)
        stores.append(sub_store)
        return core.ProcessGroupGloo.create(sub_store, rank, world_size, group_id)

    return new_process_group_impl


def apply(timeout_s: int = 120) -> list[str]:
    """Install the six patches (idempotent). Call before fleet.init, i.e. before TrainingArguments is built."""
    import paddle

    check_version(paddle.__version__)
    if APPLIED:
        return APPLIED
    import paddle.distributed as dist
    import paddle.distributed.fleet.layers.mpu.mp_ops as mp_ops
    import paddle.distributed.fleet.meta_parallel.tensor_parallel as tensor_parallel
    import paddle.distributed.fleet.utils.hybrid_parallel_util as hybrid_parallel_util
    from paddle.base import core
    from paddle.distributed import collective
    from paddle.distributed.fleet.meta_parallel.pp_utils import p2p_communication as p2p

    tensor_parallel.broadcast_input_data = broadcast_input_data  # 1
    hybrid_parallel_util.broadcast_input_data = broadcast_input_data
    APPLIED.append("1 broadcast_input_data without device assertion")

    for name in ("all_reduce", "all_gather_into_tensor", "broadcast"):  # 2
        setattr(core.ProcessGroupGloo, f"{name}_on_calc_stream", _blocking(name))
    core.ProcessGroupGloo.send_on_calc_stream = lambda self, tensor, dst: self.send(tensor, dst, True)
    core.ProcessGroupGloo.recv_on_calc_stream = lambda self, tensor, src: self.recv(tensor, src, True)
    APPLIED.append("2 ProcessGroupGloo.*_on_calc_stream")

    mp_ops._legacy_C_ops = _LegacyOpsWithCpuCollectives(mp_ops._legacy_C_ops)  # 3
    mp_ops._c_concat = collective._c_concat = _make_c_concat()
    APPLIED.append("3 c_identity / c_split / c_concat on CPU")

    dist.ParallelEnv._device_id = 0  # 4
    APPLIED.append("4 ParallelEnv._device_id")

    p2p.batch_send_recv_on_calc_stream = _batch_send_recv_blocking  # 5
    p2p._sync_send = True  # what PADDLE_P2P_SYNC_SEND=1 sets at import time
    APPLIED.append("5 blocking pipeline p2p, pair by pair")


    collective._new_process_group_impl = _own_store_per_gloo_group(collective._new_process_group_impl, timeout_s)  # 6
    APPLIED.append("6 one TCPStore per gloo sub-group")

    from paddle.distributed.fleet.meta_parallel import pipeline_parallel  # 7
    pipeline_parallel.PipelineParallelWithInterleave._check_sanity = _interleave_sanity
    APPLIED.append("7 interleaved pipeline on 2 stages")
    return APPLIED
