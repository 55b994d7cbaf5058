"""Help on every field of New run, Export and Playground: what it does, the typical range, and
the command-line flag that sets the same thing."""

from __future__ import annotations


def tip(what: str, typical: str, flag: str) -> str:
    return f"{what}\nTypical: {typical}.\nCommand line: {flag}"


CONFIG = "only in a settings file (--config)"

# SettingsForm's fields (app.views.new_run.settings_form), by key
SETTINGS_TIPS = {
    "mode": tip("LoRA trains small adapters beside frozen weights; full fine-tuning changes the "
                "model's unquantized tensors; hybrid does both.", "LoRA", "--mode"),
    "rank": tip("The adapters' size: more rank learns more, and overfits sooner.",
                "4-16 for a style, 32-64 for new knowledge", "--rank"),
    "expert_rank": tip("The rank of the adapters on the MoE experts (each expert has its own): "
                       "they hold most of the trainable parameters on a model with many "
                       "experts. auto: the LoRA rank, at most 8 past 32 experts.",
                       "auto, or 4-16", "--expert-rank"),
    "alpha": tip("The adapters' strength: the update is scaled by alpha / rank.",
                 "2 x rank", "--alpha"),
    "rslora": tip("Scale by alpha / sqrt(rank) instead, so a higher rank keeps its strength.",
                  "off", CONFIG + " (train.rslora)"),
    "dropout": tip("Drops adapter inputs at random while training, against overfitting.",
                   "0-0.1", "--dropout"),
    "targets": tip("Which weights get adapters; each box shows the parameters it adds.",
                   "attention + experts + router on MoE, attention + FFN on dense models",
                   "--targets attn,ffn,experts,shared,router,output"),
    "trainable": tip("The parameters the chosen targets train.", "well under 1% of the model",
                     "--targets"),
    "full_targets": tip("Hybrid runs: the tensors trained in full beside the adapters.",
                        "router or norms", "--full-targets"),
    "optimizer": tip("How gradients become updates. AdamW adapts the step per parameter.",
                     "AdamW", "--optimizer"),
    "lr": tip("The step size. Too high: the loss rises or jumps; too low: nothing is learned.",
              "1e-4 to 1e-3 for large models, up to 5e-3 for tiny ones", "--lr"),
    "schedule": tip("How the learning rate changes over the run after warmup.",
                    "cosine (decays to 0 at the end)", "--schedule"),
    "warmup": tip("Steps over which the learning rate rises from 0, so the first updates "
                  "are small (auto: the warmup fraction of the run's steps).", "auto",
                  "--warmup"),
    "max_grad_norm": tip("Scales the whole gradient down when its norm passes this (0: off): "
                         "the guard against a bad batch.", "1.0", "--max-grad-norm"),
    "gclip": tip("Clips each gradient value to +-this before the update (0: off); the "
                 "gradient-norm clip is the usual guard.", "off", "--gclip"),
    "weight_decay": tip("Pulls the trained weights towards 0 a little each step.", "0-0.1",
                        "--weight-decay"),
    "seed": tip("Fixes the data order, the validation split and dropout: the same seed gives "
                "the same run.", "any", "--seed"),
    "device": tip("Where the run computes: the CPU (NumPy) or a CUDA GPU (CuPy).",
                  "CPU unless a GPU is installed", "--device"),
    "precision": tip("What the frozen model's products compute in. bf16 runs them on the "
                     "CPU's matrix units (AMX or AVX512-BF16) with float32 sums, several times "
                     "faster than float32 there; the adapters, gradients, optimizer and loss "
                     "stay float32. auto: bf16 where the CPU has the unit and the bf16 extra "
                     "is installed (pip install -e '.[bf16]'), else float32. bf16 on a CPU "
                     "without the unit is emulated: the same numbers, slower.", "auto",
                     "--precision"),
    "epochs": tip("Passes over the training rows (0: count steps instead).", "1-3",
                  "--epochs"),
    "max_steps": tip("A cap on optimizer steps (with epochs 0: exactly this many).",
                     "no cap", "--max-steps"),
    "context": tip("Tokens per training window; longer rows are truncated, split or dropped.",
                   "up to the model's context, 512 or less on a CPU", "--ctx"),
    "batch": tip("Windows per optimizer step (accumulated one after another).", "1-8",
                 "--batch"),
    "grad_accum": tip("Micro-steps summed into one optimizer step: a larger batch at the same "
                      "memory.", "1-4", "--grad-accum"),
    "checkpoint_interval": tip("Gradient checkpointing: keep activations every N layers and "
                               "recompute the rest; less memory, about 30% slower.",
                               "off, or 1 when memory is short", "--checkpoint-interval"),
    "val_split": tip("The share of rows held out to measure the validation loss (of a GRPO "
                     "run: prompts answered greedily and scored).", "0.05-0.2", "--val-split"),
    "eval_every": tip("Steps between validations; the best checkpoint is chosen by them.",
                      "10-100", "--eval-every"),
    "save_every": tip("Steps between checkpoints (the best one is always kept).",
                      "at the end of each epoch", "--save-every"),
    "patience": tip("Stop after this many validations without a better loss (0: off).",
                    "off, or 3-5", "--patience"),
    "eval_task": tip("A multiple-choice task (hellaswag:FILE, winogrande:FILE, mc:FILE, "
                     "FILE.jsonl) scored at every evaluation: its accuracy is a curve beside the "
                     "validation loss. Needs a validation split; one process only (1 worker).",
                     "none, or 50-200 items of a benchmark", "--eval-task"),
    "eval_task_limit": tip("The evaluation task's first N items (each evaluation scores them "
                           "all: more items, a steadier curve, slower evaluations).", "50",
                           "--eval-task-limit"),
    "best_by": tip("Which checkpoint is the run's best (always kept): the lowest "
                   "validation loss or the highest task accuracy.", "validation loss",
                   "--best-by"),
    "norms_every": tip("Steps between the adapter-norm and router-load records the Experts "
                       "screen shows (0: off).", "5-20", CONFIG + " (norms_every)"),
    "format": tip("How the JSONL rows are read: plain text, prompt/completion, chat messages, "
                  "Alpaca or ShareGPT.", "auto (detected)", "--format"),
    "overflow": tip("What happens to rows longer than the context.", "truncate",
                    "--overflow"),
    "packing": tip("pack: several short rows share a window; pad: one row a window; none: "
                   "rows as they are.", "pack", "--packing"),
    "chat_loss": tip("Which assistant turns of a chat are trained.", "every assistant turn",
                     "--chat-loss"),
    "weights_source": tip("Where per-row weights come from: a field of each row or a separate "
                          "file.", "each row's field", "--weights FILE"),
    "weight_field": tip("The row field holding the weight.", "weight or reward",
                        CONFIG + " (data_config.weight_field)"),
    "weights_path": tip("A file of weights, one per row (numbers, JSONL or CSV).",
                        "none", "--weights"),
    "normalize": tip("How the weights are rescaled before training.", "none", "--normalize"),
    "clip": tip("The range the weights are clipped to (normalisation 'clip').", "0 to 1",
                CONFIG + " (data_config.clip_range)"),
    "allow_negative": tip("Negative weights push the model away from a row (unlikelihood).",
                          "off", "--allow-negative"),
    "warmup_fraction": tip("The part of the steps the automatic warmup takes.", "0.05",
                           "--warmup-fraction"),
    "min_lr": tip("The lowest learning rate the linear or cosine schedule decays to.", "0",
                  CONFIG + " (train.min_lr)"),
    "beta1": tip("AdamW's first-moment decay.", "0.9", CONFIG + " (train.beta1)"),
    "beta2": tip("AdamW's second-moment decay.", "0.999", CONFIG + " (train.beta2)"),
    "eps": tip("AdamW's epsilon, added to the second moment's root.", "1e-8",
               CONFIG + " (train.eps)"),
    "weight_cache_mb": tip("Dequantized weights kept in memory (auto: 40% of RAM, less where "
                           "the run would pass two thirds of it; 0: dequantize at every use, "
                           "least memory).", "auto", "--weight-cache-mb"),
    "adapter": tip("Continue training this GGUF LoRA adapter instead of new adapters.",
                   "none", "--adapter"),
    "keep_last": tip("Checkpoints kept besides the best one.", "2", CONFIG + " (keep_last)"),
    "max_bad_steps": tip("Consecutive NaN/Inf steps after which the run stops.", "5",
                         CONFIG + " (max_bad_steps)"),
    "strict": tip("Refuse to start when any row is bad (default: skip and report them).", "off",
                  "--strict"),
    "vocab_chunk": tip("Vocabulary rows of the output layer computed at once (less memory, "
                       "the same result).", "the default", CONFIG + " (train.vocab_chunk)"),
    "completion_as_chat": tip("Render prompt/completion rows with the chat template as a user "
                              "and an assistant turn.", "off", "--completion-as-chat"),
    "add_eos": tip("Append end-of-text after text and completion rows and open-ended chats.",
                   "on", CONFIG + " (data_config.add_eos)"),
    "parse_special": tip("In text and completion rows, texts such as <|im_end|> become their "
                         "special tokens (chat rows always do).", "off", "--parse-special"),
    "shuffle": tip("Shuffle the packing and the order of the windows every epoch.", "on",
                   CONFIG + " (data_config.shuffle)"),
    "val_path": tip("A separate validation file instead of a split of the dataset.", "none",
                    "--val-data"),
    "chat_template": tip("The Jinja chat template that renders chat rows (and prompt/completion "
                         "rows as a chat): the model's own, or one loaded from a file (kept in "
                         "the run's config.json).", "the model's", "--chat-template FILE"),
    "beta": tip("How far the policy may move from the reference: DPO/KTO's temperature of the "
                "implicit reward, SimPO's reward scale. 0 here: the method's default.",
                "DPO/KTO 0.1, SimPO 2.0", "--beta"),
    "pref_loss": tip("DPO's loss of the reward margin: sigmoid (the paper's), hinge (SLiC) or "
                     "ipo (squared, against overfitting to the pairs).", "sigmoid",
                     "--pref-loss"),
    "label_smoothing": tip("DPO/SimPO's sigmoid loss: the chance a pair's labels are the wrong "
                           "way round (conservative DPO).", "0", "--label-smoothing"),
    "sft_weight": tip("DPO/SimPO: adds this times the NLL per chosen-completion token (RPO), "
                      "so the chosen answers stay likely.", "0 (off) or 1", "--sft-weight"),
    "orpo_lambda": tip("ORPO: the weight of the odds-ratio term beside the chosen "
                       "completion's NLL.", "0.1", "--orpo-lambda"),
    "simpo_gamma": tip("SimPO: the target margin between the length-normalised rewards.",
                       "0.5", "--simpo-gamma"),
    "kto_desirable_weight": tip("KTO: the weight of desirable (good) completions.", "1",
                                "--kto-desirable-weight"),
    "kto_undesirable_weight": tip("KTO: the weight of undesirable (bad) completions.", "1",
                                  "--kto-undesirable-weight"),
    "pairs_per_step": tip("Preference rows (pairs) in one optimizer step.", "8", "--batch"),
    "workers": tip("Data-parallel ranks: a run sent to a Ray cluster trains as N workers that "
                   "step together (each step takes N x the accumulated windows). Needs a "
                   "cluster under Run on.", "1", "--workers"),
}

# Continue, on the Runs screen and in the Monitor: one action (JobQueue.continue_run)
CONTINUE_TIP = ("Go on with a paused, failed, cancelled or interrupted run from its last "
                "checkpoint (from the start if it has none): a paused job is queued again in "
                "its place, a failed or cancelled one at the end, a run stopped outside the "
                "queue as a new job; the worker starts it")

# The rest of New run
NEW_RUN_TIPS = {
    "kind": tip("A supervised run copies the answers of a dataset; a GRPO run samples answers "
                "to prompts and trains towards the better-rewarded ones; DPO, ORPO, SimPO and "
                "KTO train on chosen/rejected pairs (each choice's own help says how).",
                "Supervised", "workbench train [--method ...] / workbench grpo"),
    "name": tip("The run folder's name under the runs folder.", "empty: date-time-dataset",
                "--out RUN_DIR"),
    "preset": tip("Sets the training fields for a kind of run; the line below says what it "
                  "set. Save as preset keeps your own.", "Balanced", "--config FILE"),
    "model_path": tip("The GGUF model to fine-tune (quantized files are fine).",
                      "a .gguf file", "--model"),
    "data_path": tip("The JSONL dataset.", "a .jsonl file", "--data"),
}

# Export's rows (app.views.export.view), by their label
EXPORT_TIPS = {
    "Source": tip("Export the selected run, or an adapter file with its base model.",
                  "the selected run", "workbench export RUN_DIR / --adapter FILE"),
    "Run": tip("The run being exported (select another in Runs).", "", "RUN_DIR"),
    "Checkpoint": tip("Which of the run's adapters: the best checkpoint (lowest validation "
                      "loss), the final adapter, or any kept step.", "the best checkpoint",
                      "--checkpoint best|final|STEP"),
    "Adapter": tip("A GGUF LoRA adapter file or a PEFT folder.", "adapter.gguf", "--adapter"),
    "Base model": tip("The GGUF model the adapter was trained on.", "a .gguf file",
                      "--model"),
    "Format": tip("GGUF LoRA for llama.cpp --lora, a merged GGUF model, a PEFT adapter for "
                  "Hugging Face, or an Ollama folder.", "GGUF LoRA", "--to"),
    "Tensor type": tip("The adapter's tensor type (smaller files, slightly less exact); for a "
                       "merged model, the type of the tensors the adapter changes (q8_0 only "
                       "when it keeps the adapter's effect: the export checks).", "f16",
                       "--type"),
    "Scale": tip("Multiplies the adapter's update (1: as trained).", "0.5-1.5", "--scale"),
    "Destination": tip("Where to write the export (empty: the run's exports/ folder).",
                       "the run's exports/ folder", "--out"),
    "": tip("Also compare the logits with llama.cpp's when llama-cpp-python is installed.",
            "on", "--no-llamacpp turns it off"),
}

# Playground's inputs (app.views.playground.view), by attribute name
PLAYGROUND_TIPS = {
    "model_field": tip("The base model the chat runs on.", "the run's model", "--model"),
    "source_box": tip("The adapter: one of the selected run's checkpoints, a file, or none.",
                      "the run's best checkpoint", "--adapter"),
    "checkpoint_box": tip("Which of the run's adapters: its best checkpoint, the final "
                          "adapter, or any kept step.", "the best checkpoint",
                          "workbench export RUN_DIR --step N, then --adapter"),
    "adapter_field": tip("A GGUF LoRA adapter file.", "adapter.gguf", "--adapter"),
    "view_box": tip("Base and adapter side by side, or one of them alone.", "side by side",
                    "workbench generate with and without --adapter"),
    "scale_slider": tip("The adapter's strength: 0 = the base model, 1 = as trained, 2 = twice "
                        "the update.", "1", "--scale"),
    "temperature": tip("Sampling randomness; 0 always takes the likeliest token (greedy).",
                       "0-1", "--temperature"),
    "top_p": tip("Samples only from the likeliest tokens that make up this share.", "0.9-1",
                 "--top-p"),
    "max_tokens": tip("The longest answer, in tokens.", "64-512", "--max-tokens"),
    "seed": tip("Fixes the sampling: the same seed gives the same answer.", "any", "--seed"),
    "chat_box": tip("Render the conversation with the model's chat template (unticked: the "
                    "text as it is, single turn).", "on", "--chat"),
    "stop_box": tip("End an answer at the model's end-of-sequence or end-of-turn token.", "on",
                    "always on in workbench generate"),
    "system_prompt": tip("Instructions the model sees before the conversation.", "empty",
                         "a system message in --chat"),
    "message": tip("Your next message (Ctrl+Enter sends it).", "", "--prompt"),
}

# New run's GRPO sampling fields (app.views.grpo_panel.SamplingForm), by key
GRPO_TIPS = {
    "prompts": tip("The JSONL file of prompts ({\"messages\": [...]} or {\"prompt\": ...}, with "
                   "the reference in \"answer\").", "a .jsonl file", "--prompts"),
    "group_size": tip("Completions sampled per prompt; their rewards are compared with each "
                      "other.", "4-16", "--group-size / -G"),
    "prompts_per_step": tip("Prompts per optimizer step.", "4-8", "--prompts-per-step / -P"),
    "temperature": tip("Sampling randomness; at 0 every completion of a prompt is the same and "
                       "nothing is learned.", "0.7-1.0", "--temperature"),
    "top_p": tip("Nucleus sampling: only the likeliest tokens making up this share.", "0.9-1",
                 "--top-p"),
    "max_new_tokens": tip("Tokens per completion, the end-of-turn token included.", "16-256",
                          "--max-new-tokens / -n"),
    "advantage": tip("How rewards become advantages within each group.", "group-std (GRPO)",
                     "--advantage"),
    "kl": tip("Keeps the adapter close to the base model (0: off).", "0-0.1", "--kl"),
    "answer_field": tip("The prompt rows' field the exact and numeric rewards compare with.",
                        "answer", "--answer-field"),
    "samples_every": tip("Steps between the sampled completions shown in Monitor.", "5-20",
                         "--samples-every"),
    "samples_prompts": tip("Prompt groups shown in each set of sampled completions.", "2",
                           CONFIG + " (samples_prompts)"),
    "eval_samples": tip("At each evaluation, also sample this many completions per held-out "
                        "prompt (0: greedy answers only).", "0", "--eval-samples"),
    "reward_timeout": tip("Seconds a custom reward function may take per call.", "10",
                          "--reward-timeout"),
    "micro_batch_tokens": tip("Tokens per micro-batch of the update: less memory, the same "
                              "gradient.", "2048", CONFIG + " (micro_batch_tokens)"),
    "parse_special": tip("In plain prompts, texts such as <|im_end|> become their special "
                         "tokens.", "off", "--parse-special"),
}

# Settings > Clusters (app.views.settings.clusters_panel), by field
CLUSTER_ADD = "workbench cluster add NAME URL"
CLUSTER_TIPS = {
    "name": tip("What the window and the command line call the cluster (letters, digits, "
                ". _ -). To rename one, add it again and remove the old one.", "lab-gpus",
                CLUSTER_ADD),
    "url": tip("The Ray dashboard's address: runs are sent through its Jobs API.",
               "http://head-node:8265", CLUSTER_ADD),
    "token": tip("The cluster's token (Ray started with token authentication). It is kept in "
                 "the OS keyring, never in a file; left empty, the stored token stays.",
                 "the RAY_AUTH_TOKEN of the head", CLUSTER_ADD),
    "path_map": tip("Where the cluster sees this machine's folders: LOCAL=CLUSTER pairs, "
                    "comma-separated. Runs must live under a mapped folder (a head on this "
                    "machine sees its paths as they are).", "/home/me/runs=/mnt/shared/runs",
                    CLUSTER_ADD),
    "python": tip("The Python on the cluster's nodes that has the workbench installed.",
                  "python, or /opt/workbench/.venv/bin/python", CLUSTER_ADD),
    "num_cpus": tip("CPUs each run asks the cluster for.", "1-8", CLUSTER_ADD),
    "num_gpus": tip("GPUs each run asks for (a cluster without one fails the run after a "
                    "while instead of waiting forever).", "0 or 1", CLUSTER_ADD),
}
RUN_ON_TIP = tip("Train on this computer (the worker here), or send the run to a Ray cluster "
                 "(Settings > Clusters). The run folder must be on storage the cluster sees.",
                 "This computer", "workbench train ... --queue --on CLUSTER")

# a preference run's starting adapter (SettingsForm.set_kind): its flag, and it is the reference
PREFERENCE_ADAPTER_TIP = tip("Start from this GGUF LoRA adapter (e.g. an SFT run's); DPO and "
                             "KTO then use it as the reference (none: the base, the adapter "
                             "off).", "none, or the SFT run's adapter", "--init-adapter")

# New run's run types (its Run type list), by kind: what each trains on and how
KIND_TIPS = {
    "sft": tip("Copies the answers of a dataset (text, chat, prompt/completion rows).",
               "the first run", "workbench train"),
    "grpo": tip("Samples answers to prompts and trains towards the better-rewarded ones.",
                "after SFT, with checkable answers", "workbench grpo"),
    "dpo": tip("Direct Preference Optimization: makes each pair's chosen completion more likely "
               "than its rejected one, relative to the reference (the base: the adapter off).",
               "after SFT, beta 0.1", "workbench train --method dpo"),
    "orpo": tip("Odds-Ratio Preference Optimization: the chosen completion's NLL plus lambda "
                "times an odds-ratio term; no reference model.", "lambda 0.1",
                "workbench train --method orpo"),
    "simpo": tip("SimPO: length-normalised log-probabilities as rewards, a target margin gamma; "
                 "no reference model.", "beta 2, gamma 0.5", "workbench train --method simpo"),
    "kto": tip("Kahneman-Tversky Optimization: good and bad completions, paired or not "
               "({prompt, completion, label}), against the reference.", "beta 0.1",
               "workbench train --method kto"),
}
