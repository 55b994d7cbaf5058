"""Training steps: trainable tensors, optimizer, schedule, gradient accumulation, metrics.

`TrainSession` owns what a run changes (a LoRA adapter and/or float32 master copies of fully
trained tensors) and turns micro-batches into optimizer steps. It knows nothing of files,
queues or threads; the run loop (reporting, evaluation, checkpoints) builds on it.

Data parallel: a session given a `communicator` of world_size N is one rank of N sessions that
start from the same state and step together. Each step gets the whole step's micro-batches on
every rank, computes those of its rank (indices rank, rank + N, ...), and the ranks sum their
gradients x tokens, losses, counts and routing before one division by the global token count:
every rank's optimizer sees the gradient one process computes over all the micro-batches (up
to the float32 summation order) and makes the same update.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import numpy as np

from app.engine.data.batches import Batch
from app.engine.runtime.backend import to_host
from app.engine.runtime.bf16 import choose_precision
from app.engine.model.params import TRAINABLE_TYPES
from app.engine.training.config import TrainConfig
from app.engine.training.communicator import Communicator, SingleProcess
from app.engine.errors import CheckpointError, ConfigError
from app.engine.model.lora import (LoraAdapter, LoraConfig, adapter_on, adapter_parameters,
                                   init_adapter, tensor_kind)
from app.engine.model.transformer import Model
from app.engine.training.optimizers import LBFGS, SGD, AdamW, GradAccumulator, make_schedule
from app.engine.runtime.timing import phase

FULL_GROUPS = {
    "norms": lambda name: "norm" in name,
    "router": lambda name: tensor_kind(name) == "ffn_gate_inp",
    "embeddings": lambda name: name == "token_embd.weight",
    "output": lambda name: name == "output.weight",
}


@dataclass(frozen=True)
class StepMetrics:
    step: int
    loss: float
    accuracy: float
    lr: float
    grad_norm: float
    clipped_fraction: float
    tokens: int
    tokens_per_s: float
    skipped: bool = False
    routing: dict = field(default_factory=dict, repr=False)  # MoE layer -> slots per expert


class Accumulated(NamedTuple):
    loss: float
    accuracy: float
    tokens: int
    grads: dict
    routing: dict


def full_trainable_names(model: Model, targets: Sequence[str] | None) -> list[str]:
    """Unquantized tensors to train in full: all of them (targets None) or the named groups/kinds."""
    names = [n for n, t in model.gguf.tensors.items() if t.ggml_type in TRAINABLE_TYPES]
    if targets is None:
        return names
    picks = [FULL_GROUPS.get(t, lambda name, t=t: tensor_kind(name) == t) for t in targets]
    return [n for n in names if any(pick(n) for pick in picks)]


class TrainSession:
    def __init__(self, model: Model, config: TrainConfig, adapter: LoraAdapter | None = None,
                 communicator: Communicator | None = None):
        config.validate()
        self.model, self.config = model, config
        self.communicator = communicator or SingleProcess()
        self.adapter = adapter
        if config.mode in ("lora", "hybrid") and adapter is None:
            self.adapter = init_adapter(model.tensor_shapes, model.config.arch, LoraConfig(
                config.lora_rank, config.lora_alpha, tuple(config.lora_targets), config.rslora,
                config.seed, config.expert_rank))
        full_names = []
        if config.mode == "full":
            full_names = full_trainable_names(model, None)
        elif config.mode == "hybrid":
            full_names = full_trainable_names(model, config.full_targets)
        if config.mode != "lora" and not full_names:
            raise ConfigError("Nothing to train in full: every matching tensor is quantized.",
                              "Full fine-tuning needs F32/F16/BF16 tensors; use LoRA instead.")
        xp = model.xp
        if self.adapter is not None:
            self.adapter = adapter_on(self.adapter, xp)
        self.full = {n: xp.asarray(np.array(model.gguf.array(n), dtype=np.float32))
                     for n in full_names}
        self.params = model.params(self.adapter, full=self.full, training=True)
        self.params.lora_dropout = config.lora_dropout
        self.eval_params = model.params(self.adapter, full=self.full, training=True)  # no dropout
        self.precision = choose_precision(config.precision, xp)   # the base's products
        self.params.precision = self.eval_params.precision = self.precision
        self.trainable = {**(adapter_parameters(self.adapter) if self.adapter else {}), **self.full}
        self.schedule = make_schedule(config.schedule, config.lr, config.max_steps,
                                      config.warmup_steps, config.min_lr)
        self.optimizer = self._make_optimizer()
        self.step_count = 0

    def _make_optimizer(self):
        c = self.config
        no_decay = [n for n, a in self.trainable.items() if a.ndim < 2]  # norms and biases
        if c.optimizer == "adamw":
            return AdamW(self.trainable, c.lr, c.beta1, c.beta2, c.eps, c.weight_decay, c.gclip,
                         c.max_grad_norm, no_decay)
        if c.optimizer == "sgd":
            return SGD(self.trainable, c.lr, c.weight_decay, c.gclip, c.max_grad_norm, no_decay)
        return LBFGS(self.trainable, lr=c.lr if c.lr > 0 else 1.0)

    def state_dict(self, copy: bool = True) -> dict:
        """Everything a checkpoint needs to continue exactly: trained arrays, optimizer, step.
        The trained arrays are the live ones on the CPU (device arrays are copied to the
        host); `copy=False` hands the optimizer's live moments too, for a checkpoint written
        before the next step (saving then holds no second copy of the state)."""
        return {"step": self.step_count,
                "trainable": {name: to_host(a) for name, a in self.trainable.items()},
                "optimizer": self.optimizer.state_dict(copy=copy)}

    def load_state_dict(self, state: dict) -> None:
        """Restore a state_dict in place (the optimizer keeps referencing the same arrays)."""
        saved = state["trainable"]
        if set(saved) != set(self.trainable):
            missing = sorted(set(self.trainable) ^ set(saved))[:5]
            raise CheckpointError("The checkpoint does not match this run's trainable tensors "
                                  f"(differing: {', '.join(missing)}).",
                                  "Resume with the run's own configuration.")
        for name, array in self.trainable.items():
            if saved[name].shape != array.shape:
                raise CheckpointError(f"Checkpoint tensor {name} has shape {saved[name].shape}, "
                                      f"the run expects {array.shape}.")
            array[...] = self.model.xp.asarray(saved[name])
        self.params.forget_packed()
        self.eval_params.forget_packed()
        self.optimizer.load_state_dict(state["optimizer"])
        self.step_count = int(state["step"])

    @property
    def n_trainable(self) -> int:
        return sum(int(a.size) for a in self.trainable.values())

    def loss_and_grads(self, batch: Batch):
        c = self.config
        return self.model.loss_and_grads(self.params, batch.tokens, batch.labels,
                                         batch.token_weights, batch.positions, batch.segments,
                                         c.checkpoint_interval, c.vocab_chunk)

    def _accumulate(self, micro_batches: Sequence[Batch]) -> "Accumulated":
        """Gradient of the loss over all micro-batches, normalised by their total token count
        (with data parallelism: this rank's share, summed over the ranks by `_allreduced`).

        A single micro-batch's gradients are returned as the model computed them (already
        normalised by its tokens): copying them into an accumulator would cost a pass over
        every trained parameter for nothing."""
        comm = self.communicator
        acc = GradAccumulator(average=comm.world_size == 1)
        loss_sum = correct = tokens = 0.0
        routing: dict[int, np.ndarray] = {}
        first = None  # (grads, tokens) of the first micro-batch with trained tokens
        for i in range(comm.rank, len(micro_batches), comm.world_size):
            self.params.dropout_seed = (self.config.seed, self.step_count, i)  # the global index
            loss, stats, grads = self.loss_and_grads(micro_batches[i])
            for layer, counts in stats["routing"].items():
                routing[layer] = routing.get(layer, 0) + counts
            n = stats["n_tokens"]
            if n:
                if first is None:
                    first = (grads, n)
                else:
                    if not acc.n_micro_batches:
                        acc.add(first[0], weight=first[1])
                    acc.add(grads, weight=n)
                loss_sum += loss * n
                correct += stats["n_correct"]
                tokens += n
        if comm.world_size > 1:
            if first is not None and not acc.n_micro_batches:
                acc.add(first[0], weight=first[1])
            return self._allreduced(acc.result() if acc.n_micro_batches else {}, loss_sum,
                                    correct, tokens, routing)
        if not tokens:
            raise ConfigError("The batch has no trained tokens (every label is masked).")
        result = acc.result() if acc.n_micro_batches else first[0]
        return Accumulated(loss_sum / tokens, correct / tokens, int(tokens), result, routing)

    def _allreduced(self, sums: dict, loss_sum, correct, tokens, routing: dict) -> "Accumulated":
        """This rank's sums (gradients x tokens by name, loss x tokens, correct tokens, tokens,
        routing counts) added to the other ranks', the gradients divided by the global token
        count. Every rank sends the same structure: zeros for a tensor or MoE layer its
        micro-batches did not reach (a rank may have none at an epoch's short last step); a
        tensor no rank has a gradient for stays out of the result, as in one process."""
        xp, cfg = self.model.xp, self.model.config
        total = self.communicator.allreduce_sum({
            "grads": {name: sums[name] if name in sums else xp.zeros_like(w)
                      for name, w in self.trainable.items()},
            "has_grad": [int(name in sums) for name in self.trainable],
            "loss": float(loss_sum), "correct": float(correct), "tokens": int(tokens),
            "routing": {il: routing.get(il, np.zeros(cfg.n_expert, np.int64))   # (E,) each
                        for il in range(cfg.n_layer) if cfg.layer_is_moe(il)}})
        tokens = total["tokens"]
        if not tokens:
            raise ConfigError("The batch has no trained tokens (every label is masked).")
        grads = {name: g for (name, g), has in zip(total["grads"].items(), total["has_grad"])
                 if has}
        for g in grads.values():
            xp.divide(g, float(tokens), out=g)
        return Accumulated(total["loss"] / tokens, total["correct"] / tokens, tokens, grads,
                           total["routing"])

    def step(self, micro_batches: Sequence[Batch]) -> StepMetrics:
        """One optimizer step over the micro-batches (gradient accumulation)."""
        t0 = time.perf_counter()
        lr = self.schedule(self.step_count)
        if isinstance(self.optimizer, LBFGS):
            evaluations = []  # L-BFGS evaluates several times; report the first, as for AdamW

            def closure():
                evaluations.append(self._accumulate(micro_batches))
                return evaluations[-1].loss, evaluations[-1].grads
            self.optimizer.step(closure)
            result = evaluations[0]
            grad_norm, clipped, skipped = float("nan"), 0.0, False
        else:
            result = self._accumulate(micro_batches)
            with phase("optimizer"):
                stats = self.optimizer.step(result.grads, lr=lr)
            self.params.forget_packed()        # the float32 masters changed (bf16 copies)
            self.eval_params.forget_packed()
            grad_norm, clipped, skipped = stats.grad_norm, stats.clipped_fraction, stats.skipped
        self.step_count += 1
        elapsed = time.perf_counter() - t0
        return StepMetrics(self.step_count, float(result.loss), float(result.accuracy), lr,
                           float(grad_norm), float(clipped), result.tokens,
                           result.tokens / elapsed if elapsed else 0.0, skipped, result.routing)

    def evaluate(self, batches: Sequence[Batch]) -> tuple[float, float]:
        """(loss, token accuracy) over batches, forward only (with data parallelism: each rank
        evaluates every world_size-th batch and the sums are added over the ranks)."""
        comm = self.communicator
        loss_sum = correct = tokens = 0.0
        for b in batches[comm.rank::comm.world_size]:
            loss, stats = self.model.loss(self.eval_params, b.tokens, b.labels, b.token_weights,
                                          b.positions, b.segments, self.config.vocab_chunk)
            loss_sum += loss * stats["n_tokens"]
            correct += stats["n_correct"]
            tokens += stats["n_tokens"]
        if comm.world_size > 1:
            loss_sum, correct, tokens = comm.allreduce_sum(
                [float(loss_sum), float(correct), float(tokens)])
        return loss_sum / max(tokens, 1), correct / max(tokens, 1)
