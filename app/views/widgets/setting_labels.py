"""The window's name of every run setting, keyed by its config key (flattened: "train.lora_rank",
"data_config.context", "group_size"): ONE table that New run's fields (a check box's text, else
the label beside the field) and Monitor's Compare rows (the settings in which runs differ) both
read, so a setting has one name on every screen. `setting_label(key)` falls back to the key's
last part in words for a key the table lacks (a setting added later)."""

from __future__ import annotations

SETTING_LABELS = {
    # the run's inputs and kind
    "kind": "Run kind", "model": "Model", "data": "Dataset", "prompts": "Prompts",
    "rewards": "Rewards", "adapter": "Starting adapter",
    # what trains (TrainConfig)
    "train.mode": "Mode", "train.lora_rank": "LoRA rank", "train.expert_rank": "Expert rank",
    "train.lora_alpha": "LoRA alpha", "train.rslora": "rsLoRA scaling (alpha / sqrt(rank))",
    "train.lora_dropout": "LoRA dropout", "train.lora_targets": "Targets",
    "train.full_targets": "Fully trained",
    # the optimiser
    "train.optimizer": "Optimiser", "train.lr": "Learning rate", "train.schedule": "Schedule",
    "train.warmup_steps": "Warmup steps", "train.warmup_fraction": "Warmup fraction",
    "train.min_lr": "Minimum learning rate", "train.max_grad_norm": "Gradient-norm clip",
    "train.gclip": "Per-value clip", "train.weight_decay": "Weight decay",
    "train.beta1": "AdamW beta1", "train.beta2": "AdamW beta2", "train.eps": "AdamW epsilon",
    "train.seed": "Seed", "train.device": "Compute on", "train.precision": "Precision",
    "train.weight_cache_mb": "Weight cache", "train.vocab_chunk": "Vocabulary chunk",
    "train.checkpoint_interval": "Gradient checkpointing",
    "train.grad_accum": "Gradient accumulation", "train.max_steps": "Max steps (training)",
    # length, evaluation and saving (RunConfig, GrpoConfig)
    "epochs": "Epochs", "max_steps": "Max steps", "eval_every": "Evaluate every",
    "save_every": "Save every", "patience": "Early-stop patience", "norms_every": "Heatmap every",
    "keep_last": "Checkpoints kept", "max_bad_steps": "Stop after bad steps",
    "workers": "Data-parallel workers", "eval_task": "Task at evaluations",
    "eval_task_limit": "Task items", "best_by": "Best checkpoint by",
    # the data (DataConfig)
    "data_config.context": "Context (tokens)", "data_config.val_fraction": "Validation split",
    "data_config.val_path": "Validation file", "data_config.format": "Format",
    "data_config.overflow": "Rows longer than context", "data_config.packing": "Packing",
    "data_config.chat_loss": "Chat turns trained",
    "data_config.completion_as_chat": "Prompt/completion rows as a chat",
    "data_config.add_eos": "End text rows with end-of-text",
    "data_config.parse_special": "Special-token texts become tokens",
    "data_config.shuffle": "Shuffle the windows every epoch",
    "data_config.strict": "Refuse a dataset with any bad row",
    "data_config.chat_template": "Chat template", "data_config.seed": "Data seed",
    "data_config.weight_field": "Weight field", "data_config.weights_path": "Weights file",
    "data_config.normalize": "Normalisation", "data_config.clip_range": "Clip range",
    "data_config.allow_negative_weights": "Allow negative weights (unlikelihood)",
    # GRPO (GrpoConfig)
    "group_size": "Group size", "prompts_per_step": "Prompts per step",
    "temperature": "Temperature", "top_p": "Top-p", "max_new_tokens": "Max new tokens",
    "advantage": "Advantage", "kl": "KL penalty (beta)", "answer_field": "Answer field",
    "samples_every": "Show completions every", "samples_prompts": "Prompts shown",
    "eval_samples": "Held-out samples", "reward_timeout": "Reward timeout",
    "micro_batch_tokens": "Micro-batch", "val_split": "Held-out prompts",
    "parse_special": "Special-token texts in prompts become tokens",
    # preference runs (PreferenceConfig: DPO, ORPO, SimPO, KTO)
    "beta": "Beta", "pref_loss": "DPO loss", "label_smoothing": "Label smoothing",
    "sft_weight": "SFT weight (chosen NLL)", "orpo_lambda": "ORPO lambda",
    "simpo_gamma": "SimPO gamma (target margin)",
    "kto_desirable_weight": "Desirable weight", "kto_undesirable_weight": "Undesirable weight",
    "pairs_per_step": "Pairs per step", "context": "Context (tokens)",
    "val_data": "Validation file", "completion_as_chat": "Prompt/completion rows as a chat",
    "chat_template": "Chat template",
}


def setting_label(key: str) -> str:
    """The window's name of a flattened config key ("train.lora_rank" -> "LoRA rank")."""
    if key in SETTING_LABELS:
        return SETTING_LABELS[key]
    words = key.rsplit(".", 1)[-1].replace("_", " ")
    return words[:1].upper() + words[1:]
