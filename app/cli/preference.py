"""`workbench train --method dpo|orpo|simpo|kto`: a preference run (app.engine.training.preference).

The run's options are train's (model, data, LoRA, optimizer, compute, queue, --on, --json,
--config, --out) plus the preference ones below; `--batch` is the rows (pairs) per step. The
run directory's config.json has "kind": the method, so `workbench resume`, the queue's worker,
a cluster's node and export find its loop through the run-kind table (app.engine.runs.kinds).
SFT-only data options (--format other than auto/preference/kto, --weights, --normalize,
--overflow, --packing, --chat-loss, --strict, --parse-special, --allow-negative, --patience,
--grad-accum) are refused with the reason rather than ignored.
"""

from __future__ import annotations

import sys
from pathlib import Path

from app.cli.foreground import Progress, clock, run_in_foreground, start_run
from app.cli.models import model_argument
from app.engine.errors import ConfigError
from app.engine.training import events

METHODS = ("sft", "dpo", "orpo", "simpo", "kto")
# option -> PreferenceConfig field (None on the command line: the config's, else the default)
PREFERENCE_OPTIONS = {"beta": "beta", "pref_loss": "pref_loss",
                      "label_smoothing": "label_smoothing", "sft_weight": "sft_weight",
                      "orpo_lambda": "orpo_lambda", "simpo_gamma": "simpo_gamma",
                      "kto_desirable_weight": "kto_desirable_weight",
                      "kto_undesirable_weight": "kto_undesirable_weight",
                      "batch": "pairs_per_step", "epochs": "epochs", "max_steps": "max_steps",
                      "eval_every": "eval_every", "save_every": "save_every",
                      "val_split": "val_split", "ctx": "context"}
SFT_ONLY = {"weights": "--weights", "normalize": "--normalize", "overflow": "--overflow",
            "packing": "--packing", "chat_loss": "--chat-loss", "patience": "--patience",
            "grad_accum": "--grad-accum", "strict": "--strict", "parse_special": "--parse-special",
            "allow_negative": "--allow-negative"}


def add_preference_options(parser) -> None:
    """train's --method and the preference options (their defaults: PreferenceConfig)."""
    parser.add_argument("--method", choices=METHODS,
                        help="sft (default), or preference training on chosen/rejected pairs: "
                             "dpo, orpo, simpo, kto (KTO also takes prompt/completion/label "
                             "rows)")
    g = parser.add_argument_group("preference training (--method dpo, orpo, simpo, kto)")
    g.add_argument("--init-adapter", dest="adapter",
                   help="start from this GGUF LoRA adapter; DPO and KTO then use it as the "
                        "reference (default reference: the base, the adapter off)")
    g.add_argument("--beta", type=float, help="DPO/KTO beta (default 0.1), SimPO beta "
                                              "(default 2.0)")
    g.add_argument("--pref-loss", choices=("sigmoid", "hinge", "ipo"),
                   help="DPO's loss (default sigmoid)")
    g.add_argument("--label-smoothing", type=float,
                   help="DPO/SimPO sigmoid loss: the chance a label is wrong (default 0)")
    g.add_argument("--sft-weight", type=float,
                   help="DPO/SimPO: add this x the NLL per chosen token (default 0)")
    g.add_argument("--orpo-lambda", type=float,
                   help="ORPO: weight of the odds-ratio term (default 0.1)")
    g.add_argument("--simpo-gamma", type=float, help="SimPO: target margin (default 0.5)")
    g.add_argument("--kto-desirable-weight", type=float,
                   help="KTO: weight of desirable rows (default 1)")
    g.add_argument("--kto-undesirable-weight", type=float,
                   help="KTO: weight of undesirable rows (default 1)")


def run_method(args) -> str:
    """The run's method: --method, else a --config's kind, else sft."""
    if args.method:
        return args.method
    if args.config:
        from app.engine.runtime.schema import read_config_file

        kind = read_config_file(args.config).get("kind")
        if kind in METHODS:
            return kind
    return "sft"


def preference_config_from_args(args, method: str, train: dict):
    """A PreferenceConfig from --config (if any) with the options on top; `train` is the
    TrainConfig dict the command line gives (app.cli.train.train_options)."""
    from app.engine.model.card import describe_model
    from app.engine.runtime.schema import check, read_config_file
    from app.engine.training.config import TrainConfig, check_context, default_context, default_lr
    from app.engine.training.preference import PreferenceConfig, build_preference_config

    given = [flag for name, flag in SFT_ONLY.items() if getattr(args, name, None)]
    if args.format not in (None, "auto", "preference", "kto"):
        given.append(f"--format {args.format}")
    if given:
        raise ConfigError(f"{', '.join(given)} apply to supervised runs, not to "
                          f"{method.upper()} runs.",
                          "Leave them out (a preference run trains every usable pair).")
    args.model = model_argument(args.model, args.rank, args.ctx)   # owner/name:QUANT: the Hub's
    base = read_config_file(args.config) if args.config else {}
    check({"model": "", "data": "", **base}, PreferenceConfig, args.config)
    base["kind"] = method
    for key in ("model", "data", "adapter", "val_data"):
        value = getattr(args, key, None)
        if value is not None:
            base[key] = str(Path(value).resolve())
    for option, key in PREFERENCE_OPTIONS.items():
        value = getattr(args, option, None)
        if value is not None:
            base[key] = value
    if args.completion_as_chat:
        base["completion_as_chat"] = True
    base["train"] = {**base.get("train", {}), **train}
    if "lr" not in base["train"]:
        base["train"]["lr"] = default_lr(base["train"].get("mode", TrainConfig.mode),
                                         base["train"].get("lora_alpha", TrainConfig.lora_alpha))
    if not base.get("model") or not base.get("data"):
        raise ConfigError("A run needs a model and a dataset.", "Pass --model and --data.")
    card = describe_model(base["model"])
    base.setdefault("context", default_context(card))
    config = build_preference_config(base)
    check_context(config.context, card)
    return config


def cmd_train_preference(args, method: str, train: dict) -> int:
    from app.engine.data.dataset import check_data_files
    from app.engine.data.preferences import detect_preference_format
    from app.engine.runtime.backend import array_module
    from app.engine.training.memory import check_run_memory

    train = {k: v for k, v in train.items() if k != "grad_accum"}   # --batch: pairs per step
    config = preference_config_from_args(args, method, train)
    for path in (config.data, config.val_data):
        if path:
            check_data_files(path, _data_config())
    if args.queue is not None and detect_preference_format(config.data) is None:
        raise ConfigError(f"{Path(config.data).name} is not a preference dataset.",
                          'Use rows {"prompt", "chosen", "rejected"} or, for KTO, '
                          '{"prompt", "completion", "label"}.')
    if config.adapter:
        from app.engine.model.lora import read_adapter_header

        read_adapter_header(config.adapter)
    if config.train.mode != "full" and not config.adapter:
        from app.engine.model.lora import check_model_targets

        for warning in check_model_targets(config.model, config.train.lora_targets):
            print(f"warning: {warning}", file=sys.stderr)
    if args.queue is None:
        array_module(config.train.device)
        check_run_memory(config.model, config.train, config.micro_batch_tokens)
    return start_run(args, config.to_dict(), Path(config.data).stem, execute_preference)


def _data_config():
    from app.engine.data.dataset import DataConfig

    return DataConfig()


def execute_preference(run_dir, as_json: bool, allow_changed_inputs: bool = False) -> int:
    """Run a preference run directory's config in this process (resuming its checkpoints)."""
    from app.engine.training.preference import PreferenceConfig, train_preference

    config = PreferenceConfig.from_dict(run_dir.config())
    runner = lambda report, should_stop, checkpoints: train_preference(
        config, report, should_stop, checkpoints, allow_changed_inputs=allow_changed_inputs)
    return run_in_foreground(run_dir, runner, PreferenceProgress(as_json))


def resume_preference(run_dir, args) -> int:
    if args.extend_epochs:
        from app.engine.training.preference import PreferenceConfig

        config = PreferenceConfig.from_dict(run_dir.config())
        if not config.epochs:
            raise ConfigError("--extend-epochs needs a run that counts epochs.",
                              "Runs with epochs 0 are extended by editing max_steps.")
        run_dir.write_config({**config.to_dict(),
                              "epochs": config.epochs + args.extend_epochs})
    return execute_preference(run_dir, args.json, args.allow_changed_data)


class PreferenceProgress(Progress):
    """A progress line per step (loss, accuracy, margin), eval lines with the held-out ones."""

    def __call__(self, event: dict) -> None:
        kind = event.get(events.TYPE)
        if self.as_json or kind not in (events.STEP, events.EVAL):
            return super().__call__(event)
        if kind == events.STEP:
            self._step_line(event, lambda e: (
                f"{e[events.RUN_KIND]}: step {e['step']:>5}/{e['total_steps']} "
                f"loss={e['loss']:.5f} acc={e['rewards/accuracies']:.3f} "
                f"margin={_number(e['rewards/margins'])} lr={e['lr']:.2e} "
                f"{clock(e['elapsed_s'])} eta {clock(e['eta_s'])}"))
        else:
            self._line(f"eval   step {event['step']}: loss={event['eval_loss']:.5f} "
                       f"acc={event['eval_rewards/accuracies']:.3f} "
                       f"margin={_number(event['eval_rewards/margins'])} on {event['rows']} "
                       "held-out rows" + ("  (best)" if event.get("best") else ""))


def _number(x) -> str:
    return "-" if x is None else f"{x:.4f}"
