"""The engine's door for the views: every engine name the window uses, in one place.

`app.views` imports the engine only from here (an import-linter contract in pyproject.toml
forbids it the engine's packages), so what the window depends on is this list and the packages
behind it can move freely. The command line may use it too. Importing it loads the engine
(model, training loops, export), not Qt.
"""

from __future__ import annotations

from app.engine.data.dataset import DataConfig
from app.engine.data.lint import LintReport, lint_file
from app.engine.errors import ConfigError, EngineError
from app.engine.export.exporter import (ExportTargetExists, export, source_from_adapter,
                                        source_from_run)
from app.engine.export.exporter import expected_export_size  # the size before writing
from app.engine.export.verify import llamacpp_python  # can the llama.cpp cross-check run
from app.engine.export.evaluate import compare_perplexity  # perplexity as llama-perplexity
from app.engine.evaluation.job import EvalConfig, new_eval_job  # the Evaluate screen's job
from app.engine.evaluation.runner import parse_task
from app.engine.evaluation.during_training import CHOICE_KINDS as EVAL_TASK_KINDS  # --eval-task
from app.engine.evaluation.results import saved_cell  # a saved result as text
from app.engine.evaluation.store import latest_evals, read_evals  # RUN_DIR/evals.jsonl
from app.engine.hub import client as hub  # models from the Hugging Face Hub (Get a model...)
from app.engine.hub.local import FoundModel, discover_models, model_folders
from app.engine.hub.merge import trainable_path  # a split model as one file, to train
from app.engine.model.card import (ModelCard, describe_model, human_bytes, human_count,
                                   lora_param_count)
from app.engine.model.lora import TARGET_GROUPS, load_adapter
from app.engine.model.lora import check_model_targets  # the start-of-run LoRA target rule
from app.engine.model.transformer import load_model
from app.engine.runs.clusters import Cluster, ClusterError, ClusterStore, PathMap
from app.engine.runs.executors import Poll, check_cluster, cluster_test, executor_for
from app.engine.runs.kinds import GRPO, KINDS, PREFERENCE_KINDS, SFT, RunKind, kind_of
from app.engine.runs.queue import LOCAL, PENDING, Job, JobQueue, JobStateError, can_continue
from app.engine.runs.registry import Registry, forget_run, read_registry, rename_run
from app.engine.runs.rundir import (RUN_NAME_MAX, RunDir, dedupe_steps, default_run_name,
                                    default_runs_dir, list_runs)
from app.engine.runs.rundir import (RunEntry, best_checkpoint, registered_run_paths,
                                    registered_runs, run_entry)
from app.engine.runs.worker import (ensure_worker, job_state, stop_worker, worker_pid,
                                    worker_running)
from app.engine.runtime.backend import gpu_available
from app.engine.runtime.bf16 import choose as precision_choice  # auto's choice here, and why
from app.engine.runtime.files import read_range  # a tail's bounded read, never of a FIFO
from app.engine.runtime.schema import check, read_config_file
from app.engine.text.chat_template import chat_prompt_ids, generation_prompt_ids
from app.engine.text.chat_template import read_chat_template  # a run's template from a file
from app.engine.training.config import TrainConfig
from app.engine.training.config import check_context, default_context, default_lr
from app.engine.training.grpo import GrpoConfig, build_grpo_config
from app.engine.training.preference import (DEFAULT_BETA, PreferenceConfig,
                                            build_preference_config)
from app.engine.data.preferences import lint_preference_file  # a preference file's lint
from app.engine.training.memory import TrainingMemory, estimate_memory
from app.engine.training.reward_functions import (TRUST_SCOPE, RewardSpec, trust_reward_files,
                                                  untrusted_reward_files)
from app.engine.training.sft import RunConfig

__all__ = [
    # errors
    "ConfigError", "EngineError",
    # runs: the run directory, the queue, the worker process, the run kinds
    "RUN_NAME_MAX", "RunDir", "dedupe_steps", "default_run_name", "default_runs_dir", "list_runs",
    "LOCAL", "PENDING", "Job", "JobQueue", "JobStateError", "can_continue",
    # clusters: where a job runs (Settings > Clusters, New run's "Run on")
    "Cluster", "ClusterError", "ClusterStore", "PathMap", "check_cluster", "cluster_test",
    "executor_for", "Poll",
    "ensure_worker", "job_state", "stop_worker", "worker_pid", "worker_running",
    "RunEntry", "best_checkpoint", "registered_run_paths", "registered_runs",
    "Registry", "forget_run", "read_registry", "rename_run",
    "check_context", "default_context",
    "default_lr", "run_entry",
    "GRPO", "KINDS", "PREFERENCE_KINDS", "SFT", "RunKind", "kind_of",
    # models: the card, LoRA targets, loading for the Playground
    "ModelCard", "describe_model", "human_bytes", "human_count", "lora_param_count",
    "TARGET_GROUPS", "load_adapter", "load_model", "chat_prompt_ids", "generation_prompt_ids",
    "check_model_targets", "read_chat_template",
    # models on this computer and on the Hugging Face Hub (hub.search, hub.list_models, ...)
    "FoundModel", "discover_models", "model_folders", "hub", "trainable_path",
    # configs, the settings-file schema, datasets, memory
    "DataConfig", "GrpoConfig", "RewardSpec", "RunConfig", "TrainConfig", "build_grpo_config",
    "DEFAULT_BETA", "PreferenceConfig", "build_preference_config", "lint_preference_file",
    "TRUST_SCOPE", "trust_reward_files", "untrusted_reward_files", "check", "read_config_file",
    "LintReport", "lint_file", "TrainingMemory", "estimate_memory", "gpu_available", "read_range",
    "precision_choice",
    # export
    "ExportTargetExists", "export", "source_from_adapter", "source_from_run",
    "compare_perplexity", "expected_export_size", "llamacpp_python",
    # evaluation: benchmark tasks and prompt suites, queued as a job (the Evaluate screen)
    "EvalConfig", "new_eval_job", "parse_task", "EVAL_TASK_KINDS", "read_evals", "latest_evals",
    "saved_cell",
]
