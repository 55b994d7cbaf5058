"""Fake run directories for the view tests: the same files and events the engine writes
(`app.engine.training.sft.train` through `RunDir`), written progressively, optionally from a thread."""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path

import numpy as np

from app.engine.runs.reporter import record_event
from app.engine.runs.rundir import RunDir
from app.engine.runtime.files import append_line, to_json

EXPERT_KINDS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
DENSE_KINDS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def fake_config(**overrides) -> dict:
    cfg = {"model": "/models/tiny-moe.gguf", "data": "/data/chat.jsonl",
           "train": {"mode": "lora", "lora_rank": 8, "lora_alpha": 16.0,
                     "lora_targets": ["attention", "experts", "router"], "lr": 0.005,
                     "schedule": "constant", "max_steps": 100, "seed": 0},
           "data_config": {"context": 512, "val_fraction": 0.1},
           "epochs": 2, "max_steps": 0, "eval_every": 10, "save_every": 0, "norms_every": 10}
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    return cfg


class FakeRun:
    """A run directory written like the engine writes it.

    `layers` x `experts` expert adapters (gate/up/down), or with `experts=0` a dense model
    with per-module adapters. Norm of expert e in layer l grows like (l + 1) * (e + 1) * step,
    except `frozen` (layer, expert) pairs that stay ~0; routing gives `dead` (layer, expert)
    pairs no tokens.
    """

    def __init__(self, path: str | Path, *, total_steps: int = 100, layers: int = 4,
                 experts: int = 8, frozen=(), dead=(), config: dict | None = None,
                 status_state: str = "running"):
        self.run = RunDir.create(path, config or fake_config())
        self.path = str(self.run.path)
        self.total_steps = total_steps
        self.layers, self.experts = layers, experts
        self.frozen, self.dead = set(frozen), set(dead)
        self.step_no = 0
        self._recording: list | None = None
        self.run.write_status(state=status_state, step=0, total_steps=total_steps, fsync=False)
        self._append({"type": "start", "total_steps": total_steps, "epochs": 2,
                                 "steps_per_epoch": total_steps // 2, "trainable": 1000,
                                 "train_rows": 90, "val_rows": 10, "resumed_at": 0})

    def _append(self, event: dict) -> None:
        if self._recording is None:
            record_event(self.run, event)       # metrics.jsonl, and log.txt's readable line
        else:
            self._recording.append(("line", to_json({"type": "step", **event,
                                                     "time": time.time()})))

    def _status(self, **fields) -> None:
        if self._recording is None:
            self.run.write_status(fsync=False, **fields)
        else:
            self._recording.append(("status", fields))

    def prerender(self, steps: int, *, every: int = 10) -> list:
        """`play(steps)`'s writes, serialized now, for `replay_in_thread` (a writer thread
        that only writes, as the engine process does, so the test's GIL is the reader's)."""
        self._recording = []
        try:
            self.play(steps, every=every)
            return self._recording
        finally:
            self._recording = None

    def replay(self, writes: list, delay_s: float = 0.0) -> None:
        for kind, value in writes:
            if kind == "line":
                append_line(self.run.metrics_path, value)
            else:
                self.run.write_status(fsync=False, **value)
            if delay_s:
                time.sleep(delay_s)

    def replay_in_thread(self, writes: list, delay_s: float = 0.0) -> threading.Thread:
        t = threading.Thread(target=self.replay, args=(writes, delay_s), daemon=True)
        t.start()
        return t

    @staticmethod
    def loss_at(step: int) -> float:
        return 3.0 * math.exp(-step / 40.0) + 0.5

    def step(self, n: int = 1, *, status: bool = True) -> None:
        for _ in range(n):
            self.step_no += 1
            s = self.step_no
            self._append({
                "type": "step", "step": s, "total_steps": self.total_steps, "epoch": 1,
                "epochs": 2, "loss": self.loss_at(s), "accuracy": 0.5, "lr": 0.005 * (1 - s / 200),
                "grad_norm": 1.0 + 1.0 / s, "clipped_fraction": 0.25 if s % 2 else 0.0,
                "tokens": 300, "tokens_per_s": 2000.0 + s, "skipped": False,
                "elapsed_s": 0.1 * s, "eta_s": 0.1 * (self.total_steps - s)})
        if status:
            self._status(state="running", step=self.step_no,
                                  total_steps=self.total_steps, epoch=1,
                                  loss=self.loss_at(self.step_no),
                                  eta_s=0.1 * (self.total_steps - self.step_no))

    def eval(self, **extra) -> None:
        """An eval event; `extra`: more of its fields (--eval-task's `task`, `task_acc`)."""
        self._append({"type": "eval", "step": self.step_no,
                                 "loss": self.loss_at(self.step_no) + 0.1, "accuracy": 0.5,
                                 "perplexity": 3.0, "best": True, **extra})

    def norm_of(self, layer: int, expert: int, kind_index: int = 0) -> float:
        if (layer, expert) in self.frozen:
            return 1e-6
        return (layer + 1) * (expert + 1) * self.step_no * 0.01 * (1 + kind_index)

    def norms(self) -> None:
        tensors = {}
        for layer in range(self.layers):
            if self.experts:
                for k, kind in enumerate(EXPERT_KINDS):
                    d = [self.norm_of(layer, e, k) for e in range(self.experts)]
                    tensors[f"blk.{layer}.{kind}.weight"] = {"delta": d, "a": d, "b": d}
                tensors[f"blk.{layer}.attn_q.weight"] = {"delta": [0.5], "a": [1.0], "b": [0.5]}
            else:
                for m, kind in enumerate(DENSE_KINDS):
                    d = [self.norm_of(layer, m)]
                    tensors[f"blk.{layer}.{kind}.weight"] = {"delta": d, "a": d, "b": d}
        self._append({"type": "norms", "step": self.step_no, "tensors": tensors})

    def routing(self) -> None:
        layers = {}
        for layer in range(self.layers):
            load = np.array([0.0 if (layer, e) in self.dead else 1.0 + e
                             for e in range(self.experts)])
            layers[str(layer)] = (load / load.sum()).tolist()
        self._append({"type": "routing", "step": self.step_no, "layers": layers})

    def log(self, message: str) -> None:
        self._append({"type": "log", "message": message})

    def finish(self, state: str = "done", error: dict | None = None) -> None:
        self._append({"type": "done", "step": self.step_no, "reason": "finished",
                      "best_step": self.step_no, "best_loss": 1.0})
        self._status(state=state, error=error)

    def play(self, steps: int, *, every: int = 10, delay_s: float = 0.0) -> None:
        """Write `steps` steps, with norms, routing and eval events every `every` steps."""
        for _ in range(steps):
            self.step(status=self.step_no % 5 == 0)
            if self.experts and self.step_no % every == 0:
                self.routing()
            if self.step_no % every == 0:
                self.norms()
                self.eval()
            if delay_s:
                time.sleep(delay_s)
        self.step(0)

    def play_in_thread(self, steps: int, **kw) -> threading.Thread:
        t = threading.Thread(target=self.play, args=(steps,), kwargs=kw, daemon=True)
        t.start()
        return t


def fake_grpo_config(**overrides) -> dict:
    """A GRPO run's config.json (app.engine.training.grpo.GrpoConfig.to_dict) with two rewards."""
    from app.engine.training.config import TrainConfig
    from app.engine.training.grpo import GrpoConfig
    from app.engine.training.reward_functions import RewardSpec

    config = GrpoConfig(model="/models/tiny-moe.gguf", prompts="/data/addition.jsonl",
                        rewards=(RewardSpec("exact"), RewardSpec("format", 0.5, arg="answer")),
                        train=TrainConfig(lora_rank=8, lora_alpha=16, lr=5e-4), group_size=4,
                        prompts_per_step=2, max_steps=20, val_split=0.1, eval_every=10)
    return {**config.to_dict(), **overrides}


class FakeGrpoRun:
    """A GRPO run directory written like `app.engine.training.grpo.train_grpo` writes it: the reward at
    step s is `reward_at(s)`, the exact reward's mean that, the format reward's 1 - that."""

    def __init__(self, path: str | Path, *, total_steps: int = 20, group_size: int = 4):
        self.run = RunDir.create(path, fake_grpo_config(max_steps=total_steps,
                                                        group_size=group_size))
        self.path = str(self.run.path)
        self.total_steps, self.group_size = total_steps, group_size
        self.step_no = 0
        self.run.write_status(state="running", step=0, total_steps=total_steps, fsync=False)
        record_event(self.run, {"type": "start", "kind": "grpo", "total_steps": total_steps,
                                "epochs": 1, "trainable": 1000, "prompt_rows": 20,
                                "train_prompts": 18, "val_prompts": 2, "skipped_rows": 0,
                                "group_size": group_size, "prompts_per_step": 2,
                                "advantage": "group-std", "kl": 0.0, "resumed_at": 0,
                                "rewards": [{"name": "exact", "kind": "exact", "weight": 1.0},
                                            {"name": "format", "kind": "format",
                                             "weight": 0.5}]})

    @staticmethod
    def reward_at(step: int) -> float:
        return min(1.0, 0.05 * step)

    def step(self, n: int = 1) -> None:
        for _ in range(n):
            self.step_no += 1
            s, r = self.step_no, self.reward_at(self.step_no)
            self.run.append_metrics({
                "type": "step", "kind": "grpo", "step": s, "total_steps": self.total_steps,
                "epoch": 1, "epochs": 1, "loss": -0.01 * s, "accuracy": 0.5, "lr": 5e-4,
                "grad_norm": 1.0, "clipped_fraction": 0.0, "tokens": 40, "tokens_per_s": 400.0,
                "skipped": False, "reward_mean": r + 0.5 * (1 - r), "reward_std": 0.1 * s,
                "rewards": {"exact": {"mean": r, "std": 0.3}, "format": {"mean": 1 - r,
                                                                         "std": 0.2}},
                "zero_spread_fraction": 0.5 if s % 2 else 0.0,
                "completion_len_mean": 3.0 + s, "completion_len_min": 1, "completion_len_max":
                    5 + s, "completion_clipped_fraction": 0.25, "advantage_mean": 0.0,
                "advantage_std": 1.0, "advantage_abs_mean": 0.8, "kl": None, "step_s": 0.5,
                "elapsed_s": 0.5 * s, "eta_s": 0.5 * (self.total_steps - s)})
        self.run.write_status(state="running", step=self.step_no, total_steps=self.total_steps,
                              reward_mean=r + 0.5 * (1 - r), fsync=False)   # as the worker

    def item(self, k: int, advantage: float | None) -> dict:
        """Completion `k` of the step: prompt k // G, "What is k + 1?" and a long completion."""
        prompt = f"What is {k // self.group_size} + 1?"
        completion = f"{k} " + "and more " * (8 * (k % 2))
        return {"prompt_index": k // self.group_size, "line": k // self.group_size + 1,
                "sample": k % self.group_size, "prompt": prompt,
                "answer": str(k // self.group_size + 1), "completion": completion,
                "reward": float(k % 2), "rewards": {"exact": float(k % 2), "format": 0.0},
                "advantage": advantage, "length": 2 + k, "finished": k % 3 != 0}

    def samples(self) -> list[dict]:
        items = [self.item(k, 1.0 if k % 2 else -1.0) for k in range(2 * self.group_size)]
        self.run.append_metrics({"type": "samples", "kind": "grpo", "step": self.step_no,
                                 "items": items})
        return items

    def eval(self, reward: float) -> None:
        self.run.append_metrics({
            "type": "eval", "kind": "grpo", "step": self.step_no, "prompts": 2,
            "reward_mean": reward, "reward_std": 0.0,
            "rewards": {"exact": {"mean": reward, "std": 0.0}, "format": {"mean": 0.0,
                                                                          "std": 0.0}},
            "completion_len_mean": 3.0, "completion_clipped_fraction": 0.0,
            "examples": [self.item(k, None) for k in range(2)], "eval_s": 0.1})
