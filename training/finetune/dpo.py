"""Preference losses (finetune.method=dpo / simpo, docs/finetune.md) and the Trainer that computes them.

PaddleNLP 2.8.1 has no DPO trainer (it came with paddlenlp/trl later), so the loss is written here, as TRL's
`DPOTrainer` and `CPOTrainer(loss_type="simpo")` define it:

    dpo    reward = beta * (log p(answer) - log p_ref(answer)), log-probabilities summed over the answer's tokens;
           loss = -log sigmoid(reward_chosen - reward_rejected). The reference's log-probabilities come with the
           batch (computed once: training/finetune/preference.py), so at step 0 every reward is 0 and the loss ln 2.
    simpo  reward = simpo_beta * mean log p(answer) over its tokens (no reference);
           loss = -log sigmoid(reward_chosen - reward_rejected - simpo_gamma).
    both   + sft_weight * the chosen answer's mean negative log-likelihood (against both likelihoods falling).

Metrics, named as TRL and PaddleNLP name them: rewards/chosen, rewards/rejected, rewards/margins,
rewards/accuracies, logps/chosen, logps/rejected (means over the logging window, eval_ in front for the validation
pairs). A pair's two rows go through the model in one forward (chosen rows, then rejected rows).
"""
from __future__ import annotations

import math

import paddle
import paddle.nn.functional as F

from core import tracking

IGNORE = -100
METRICS = tracking.PREFERENCE_METRICS


def causal_lm(model):
    """The LlamaForCausalLM inside fleet's data / tensor-parallel wrapper (`_layers`: its forward adds nothing the
    pair loss needs; the gradients' all-reduce hooks are on the parameters) and a LoRA wrapper (`model`: its layers
    are the wrapper's, the adapters applied)."""
    while not hasattr(model, "criterion"):
        model = model._layers if hasattr(model, "_layers") else model.model
    return model


def sequence_logps(model, input_ids, labels):
    """([rows] log-probability of each row's labelled tokens, summed; [rows] how many there are). The LM head and
    the cross entropy run on the labelled positions alone (a review's answer is 3 of 128 positions: the full
    [rows, length, vocabulary] logits cost more than the decoder layers of a small model); the criterion's per-token
    loss_func is the one training uses (plain, or vocabulary-parallel under tensor parallel)."""
    lm = causal_lm(model)
    hidden = lm.llama(input_ids=input_ids)[0]
    rows, length = input_ids.shape
    flat = (labels != IGNORE).flatten()
    where = paddle.nonzero(flat).squeeze(-1)
    picked = paddle.gather(hidden.reshape([rows * length, hidden.shape[-1]]), where).unsqueeze(0)
    token_labels = paddle.gather(labels.flatten(), where).unsqueeze(0)
    token_loss = lm.criterion.loss_func(lm.lm_head(picked).astype("float32"), token_labels.unsqueeze(2)).reshape([-1])
    row_of = (where // length).astype("int64")
    logps = paddle.scatter(paddle.zeros([rows], "float32"), row_of, -token_loss, overwrite=False)
    counts = paddle.scatter(paddle.zeros([rows], "float32"), row_of, paddle.ones_like(token_loss), overwrite=False)
    if isinstance(model, paddle.DataParallel) and model._strategy.nranks > 1 and paddle.is_grad_enabled() \
            and model.grad_need_sync:
        # (what paddle.DataParallel.forward does after the layers' forward, skipped with it: its gradient reducer
        # learns this step's outputs, else the data-parallel all-reduce of the gradients does not run)
        model._reducer.prepare_for_backward(list(model._find_tensor(logps)))
    return logps, counts


def objective(settings, chosen, rejected, chosen_tokens, rejected_tokens, reference=None):
    """(loss, {metric: value tensor}) of a batch: `chosen` / `rejected` the policy's summed log-probabilities,
    `reference` [rows, 2] the reference's (dpo)."""
    if settings.method == "dpo":
        chosen_reward = settings.beta * (chosen - reference[:, 0])
        rejected_reward = settings.beta * (rejected - reference[:, 1])
        loss = -F.log_sigmoid(chosen_reward - rejected_reward).mean()
    else:
        chosen_reward = settings.simpo_beta * chosen / chosen_tokens
        rejected_reward = settings.simpo_beta * rejected / rejected_tokens
        loss = -F.log_sigmoid(chosen_reward - rejected_reward - settings.simpo_gamma).mean()
    if settings.sft_weight:
        loss = loss + settings.sft_weight * (-(chosen / chosen_tokens)).mean()
    values = (chosen_reward, rejected_reward, chosen_reward - rejected_reward,
              (chosen_reward > rejected_reward).astype("float32"), chosen, rejected)
    return loss, {name: value.mean().detach() for name, value in zip(METRICS, values)}


def pair_loss(settings, model, inputs):
    """(loss, metrics) of a batch of pairs as the Trainer feeds them (training/finetune/preference.py Pairs)."""
    rows = inputs["chosen_input_ids"].shape[0]
    logps, tokens = sequence_logps(model, paddle.concat([inputs["chosen_input_ids"], inputs["rejected_input_ids"]]),
                                   paddle.concat([inputs["chosen_labels"], inputs["rejected_labels"]]))
    return objective(settings, logps[:rows], logps[rows:], tokens[:rows], tokens[rows:], inputs.get("reference"))


def trainer_class(base, settings):
    """`base` (a Trainer class) with the preference loss for training and evaluation, and the metrics' means added
    to each log (averaged over the data-parallel ranks, as the loss is)."""

    class PreferenceTrainer(base):
        sums = None  # {"train" | "eval": {metric: running sum tensor}, and the batch count}

        def compute_loss(self, model, inputs, return_outputs=False):
            loss, metrics = pair_loss(settings, model, inputs)
            self._add("train", metrics)
            return (loss, None) if return_outputs else loss

        def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
            inputs = self._prepare_inputs(inputs)
            with paddle.no_grad():
                loss, metrics = pair_loss(settings, model, inputs)
            self._add("eval", metrics)
            return loss.detach(), None, None

        def _add(self, phase, metrics):
            self.sums = self.sums or {}
            window = self.sums.setdefault(phase, {"batches": 0})
            window["batches"] += 1
            for name, value in metrics.items():
                window[name] = window[name] + value if name in window else value

        def log(self, logs, **kwargs):
            phase, prefix = ("eval", "eval_") if "eval_loss" in logs else ("train", "")
            if ("loss" in logs or "eval_loss" in logs) and self.sums and phase in self.sums:
                window = self.sums.pop(phase)
                for name in METRICS:
                    mean = window[name] / window["batches"]
                    if self.args.world_size > 1:
                        mean = self._nested_gather(mean.reshape([1])).mean()  # (every rank logs: a collective)
                    logs[prefix + name] = round(float(mean), 6)
            return super().log(logs, **kwargs)

    return PreferenceTrainer


def logps_function(model):
    """(ids, labels) numpy -> [rows] summed log-probabilities under `model` as it is now, without gradients (the
    reference's, before the first step)."""

    def logps_of(ids, labels):
        was_training = model.training
        model.eval()
        with paddle.no_grad():
            values, _ = sequence_logps(model, paddle.to_tensor(ids), paddle.to_tensor(labels))
        if was_training:
            model.train()
        return values.numpy()

    return logps_of


LN2 = math.log(2.0)  # the dpo loss while the policy is the reference
