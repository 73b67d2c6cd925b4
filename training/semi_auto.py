"""`parallel.mode: semi_auto`: Paddle's semi-automatic parallel API trains the plain `LlamaForCausalLM`.

The user states the layout (data x tensor degrees); the ranks form a `ProcessMesh` [dp, mp], every batch is sharded
over "dp" and each weight is placed with `dist.shard_layer` (the Megatron placements); Paddle inserts the
communication:

- q/k/v, gate/up projections: column parallel, weight [in, out] split on out (`Shard(1)` over mp);
- o/down projections: row parallel, weight split on in (`Shard(0)` over mp); their output is a `Partial` sum, which
  a forward hook turns back into a replicated tensor (an all-reduce) -- left Partial, the residual add would ask for
  a reduce-scatter, which has no CPU kernel in Paddle 2.6.2;
- embedding and LM head: split on the hidden / vocabulary axis (`Shard(1)`), their outputs replicated the same way;
- norms: replicated. Every weight is replicated over dp; Paddle reduces the gradients over dp.

Eager mode on CPU (gloo) and GPU alike; the static `dist.to_static` path needs CUDA in 2.6.2 and is not used.
Checkpoints hold the model's full tensors (gathered from the placements), so export reads them like any other; the
optimizer state is not saved (Trainer would `paddle.save` distributed tensors, which fails), so a semi_auto run does
not resume: training/launch/train_run.py refuses RESUME for it before launch.
"""
from __future__ import annotations

import os

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")
VOCAB = ("embed_tokens", "lm_head")


def placements(layer_name: str, param_name: str) -> tuple[str, str]:
    """(dp placement, mp placement) of a parameter, as names: 'R' replicate, 'S0' / 'S1' shard on that axis."""
    if layer_name.endswith(COLUMN):
        return ("R", "S1" if param_name == "weight" else "S0")
    if layer_name.endswith(ROW):
        return ("R", "S0" if param_name == "weight" else "R")
    if layer_name.endswith(VOCAB):
        return ("R", "S1")
    return ("R", "R")


def _placement(name: str):
    import paddle.distributed as dist

    return dist.Replicate() if name == "R" else dist.Shard(int(name[1]))


def mesh_2d(dp: int, tp: int):
    """Ranks 0..dp*tp-1 as a [dp, mp] grid, the tensor-parallel rank varying fastest (as fleet numbers them)."""
    import paddle.distributed as dist

    return dist.ProcessMesh([[d * tp + t for t in range(tp)] for d in range(dp)], dim_names=["dp", "mp"])


def shard_model(model, mesh):
    import paddle.distributed as dist

    def shard_fn(layer_name, layer, process_mesh):
        for param_name, param in list(layer.named_parameters(include_sublayers=False)):
            where = [_placement(p) for p in placements(layer_name, param_name)]
            layer.add_parameter(param_name, dist.shard_tensor(param, process_mesh, where))

    dist.shard_layer(model, mesh, shard_fn)

    def replicate_output(layer, inputs, output):
        return dist.reshard(output, mesh, [dist.Shard(0), dist.Replicate()])

    for name, layer in model.named_sublayers():
        if name.endswith(ROW + VOCAB):
            layer.register_forward_post_hook(replicate_output)
    return model


def full_state_dict(model) -> dict:
    """Every parameter as a whole tensor (a collective: all ranks call it)."""
    import paddle.distributed as dist

    out = {}
    for key, value in model.state_dict().items():
        if value.is_dist():
            value = dist.reshard(value, value.process_mesh, [dist.Replicate()] * len(value.placements))
            value = value._local_value()
        out[key] = value
    return out


def make_trainer(mesh, **kwargs):
    """PaddleNLP's Trainer driving a model whose weights are distributed tensors.

    PaddleNLP 2.8.1 ships an `AutoTrainer` for this, but it calls `ProcessMesh.get_rank_by_dim_and_process_id`,
    which Paddle 2.6.2 lacks. So the ordinary Trainer runs as if on one process (no fleet wrapping: the distributed
    tensors carry the communication), every rank reads the same global batch, and the batch becomes a tensor
    sharded over "dp" just before the forward (SemiAutoMethods)."""
    from paddlenlp.trainer import Trainer

    return type("SemiAutoTrainer", (SemiAutoMethods, Trainer), {"mesh": mesh})(**kwargs)


class SemiAutoMethods:
    """What the semi-automatic mode changes in PaddleNLP's Trainer (mixed in before it by make_trainer)."""

    mesh = None

    def _wrap_model(self, model, training=True):
        return model

    def _sampler(self, dataset, batch_size):
        from paddle.io import DistributedBatchSampler

        # One global order for every rank (and every layout: training/rank.py make_trainer).
        return DistributedBatchSampler(dataset, batch_size=batch_size, shuffle=True, num_replicas=1, rank=0,
                                       drop_last=self.args.dataloader_drop_last)

    def _get_train_sampler(self):
        return self._sampler(self.train_dataset, self.args.per_device_train_batch_size)

    def _get_eval_sampler(self, eval_dataset):
        from paddle.io import DistributedBatchSampler

        return DistributedBatchSampler(eval_dataset, batch_size=self.args.per_device_eval_batch_size,
                                       shuffle=False, num_replicas=1, rank=0)

    def compute_loss(self, model, inputs, return_outputs=False):
        import paddle.distributed as dist

        sharded = {k: dist.shard_tensor(v, self.mesh, [dist.Shard(0), dist.Replicate()]) for k, v in inputs.items()}
        return super().compute_loss(model, sharded, return_outputs)

    def _save_checkpoint(self, model, metrics=None):
        self._full_state = full_state_dict(self.model)  # a collective: every rank, before rank 0 saves
        try:
            super()._save_checkpoint(model, metrics)
        finally:
            self._full_state = None

    def _save(self, output_dir=None, state_dict=None, merge_tensor_parallel=False):
        # The full tensors as an ordinary PaddleNLP model (what export reads); Trainer's own _save would
        # paddle.save the distributed tensors, which it cannot.
        output_dir = output_dir or self.args.output_dir
        if self.args.should_save:
            os.makedirs(output_dir, exist_ok=True)
            self.model.save_pretrained(output_dir, state_dict=self._full_state, safe_serialization=True)

    def training_step(self, model, inputs):
        model.train()
        loss = self.compute_loss(model, self._prepare_inputs(inputs))
        if self.args.gradient_accumulation_steps > 1:
            loss = loss / self.args.gradient_accumulation_steps
        loss.backward()
        return loss._local_value().detach()

    def _nested_gather(self, tensors):
        return tensors  # every rank evaluated the same batches (gathering would double count, then truncate)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        import paddle

        model.eval()
        with paddle.no_grad():
            loss = self.compute_loss(model, self._prepare_inputs(inputs))
        return loss._local_value().detach(), None, None
