"""The run-config schema (app.engine.runtime.schema) through the CLI, resume and the worker; JSON
lines with integers over Python's digit limit; `train` naming the rows it skips."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from app.cli.main import run_cli
from app.engine.training.config import TrainConfig
from app.engine.runtime.schema import problems, read_config_file, schema
from app.engine.data.dataset import DataConfig
from app.engine.errors import ConfigError, DatasetError
from app.engine.data.formats import INVALID_JSON, Rejection, parse_line
from app.engine.training.grpo import GrpoConfig
from app.engine.runs.queue import JobQueue
from app.engine.data.row_weights import read_weights_file
from app.engine.training.sft import RunConfig
from app.engine.runs.rundir import RunDir
from app.engine.runs.kinds import run_job
from app.engine.runs.worker import run_worker
from tests.conftest import SAMPLE_DATA

from tests.fuzz import fuzz, fuzz_settings

SAMPLE = SAMPLE_DATA
MODEL = str(SAMPLE / "tiny-moe.gguf")
HUGE = "1" + "0" * 5000                   # over Python's 4300-digit int-from-string limit

# (config file name, text, what stderr must name)
BAD_CONFIGS = [
    ("run.json", '{"train": {"lora_rank": {}}}', ["train.lora_rank", "an integer", "{}"]),
    ("run.json", '{"train": {"lr": "1e-4"}}', ["train.lr", "a number > 0", '"1e-4"']),
    ("run.json", '{"train": {"lora_rank": 0}}', ["train.lora_rank", "got 0"]),
    ("run.json", '{"train": {"lr": -1}}', ["train.lr", "> 0"]),
    ("run.json", '{"epochs": -1}', ["epochs", "got -1"]),
    ("run.json", '{"data_config": {"val_fraction": 1.5}}', ["data_config.val_fraction", "[0, 1)"]),
    ("run.json", '{"train": {"beta1": 1}}', ["train.beta1", "[0, 1)"]),
    ("run.json", '{"train": {"lora_rnak": 4}}', ["train.lora_rnak", "did you mean lora_rank"]),
    ("run.json", '{"epoch": 2}', ["epoch: unknown setting", "did you mean epochs"]),
    ("run.json", '{"train": {"schedule": "cosinus"}}',
     ["train.schedule", "constant, linear, cosine", '"cosinus"', "did you mean cosine"]),
    ("run.json", '{"train": {"lora_rank": null}}', ["train.lora_rank", "got null"]),
    ("run.json", '{"train": null}', ["train: expected an object, got null"]),
    ("run.json", '{"train": {"lora_targets": "attention"}}', ["train.lora_targets", "a list"]),
    ("run.json", '{"data_config": {"clip_range": [[1], {"a": [null]}]}}',
     ["data_config.clip_range[0]", "data_config.clip_range[1]"]),
    ("run.json", '{"train": {"seed": ' + HUGE + '}}', ["run.json", "4300 digits"]),
    ("run.json", '{"train": {"lr": NaN}}', ["train.lr", "NaN"]),
    ("run.json", '{"train": {"lora_rank": 4', ["run.json", "invalid JSON", "line 1, column 26"]),
    ("run.json", '{\n  "train": {\n    "lora_rank": 4,\n  }\n}',
     ["run.json", "invalid JSON", "line 4, column 3"]),
    ("run.json", "[1, 2]", ["run.json", "expected an object"]),
    ("run.toml", "[train]\nlora_rank = \n", ["run.toml", "invalid TOML", "line 2"]),
    ("run.toml", '[train]\nlora_rank = "8"\n', ["train.lora_rank", '"8"']),
    ("run.json", '{"train": {"lora_rank": {}, "schedule": "cosinus"}, "epochs": -1}',
     ["3 problems", "train.lora_rank", "train.schedule", "epochs"]),
]


def _bad_config_ids():
    return [text[:30] for _, text, _ in BAD_CONFIGS]


@pytest.mark.parametrize("name,text,named", BAD_CONFIGS, ids=_bad_config_ids())
def test_train_rejects_a_malformed_config_naming_every_bad_key(tmp_path, capsys, name, text,
                                                                named):
    path = tmp_path / name
    path.write_text(text)
    assert run_cli(["train", "--config", str(path), "-m", MODEL, "-d",
                    str(SAMPLE / "chat.jsonl"), "-o", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    for part in named:
        assert part in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("text,named", [
    ('{"group_size": "8"}', "group_size"),
    ('{"rewards": [{"kind": "exakt"}]}', "rewards[0].kind"),
    ('{"rewards": 5}', "rewards: expected a list"),
    ('{"train": {"lora_rank": []}}', "train.lora_rank"),
    ('{"kind": "grpo", "top_p": 0}', "top_p"),
])
def test_grpo_rejects_a_malformed_config(tmp_path, capsys, text, named):
    path = tmp_path / "grpo.json"
    path.write_text(text)
    assert run_cli(["grpo", "--config", str(path), "-m", MODEL, "--prompts",
                    str(SAMPLE / "addition.jsonl"), "-o", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and named in err and "Traceback" not in err


def _hand_edited_run(tmp_path) -> RunDir:
    run = RunDir.create(tmp_path / "run", RunConfig(MODEL, str(SAMPLE / "chat.jsonl")).to_dict())
    config = json.loads(run.config_path.read_text())
    config["train"]["lora_rank"] = {}
    config["train"]["optimiser"] = "sgd"
    run.config_path.write_text(json.dumps(config))
    return run


def test_resume_of_a_hand_edited_config_names_the_keys(tmp_path, capsys):
    run = _hand_edited_run(tmp_path)
    assert run_cli(["resume", str(run.path)]) == 2
    err = capsys.readouterr().err
    assert "train.lora_rank" in err and "did you mean optimizer" in err
    assert "Traceback" not in err


def test_the_worker_fails_a_hand_edited_job_with_the_message(tmp_path):
    run = _hand_edited_run(tmp_path)
    queue = JobQueue(tmp_path / "q.sqlite3")
    job_id = queue.add(run.path)
    assert run_worker(queue, run_job, once=True, exclusive=False) == 1
    job = queue.get(job_id)
    assert job.state == "failed" and job.error["kind"] == "config"
    assert "train.lora_rank" in job.error["message"] and "train.optimiser" in job.error["message"]


def test_every_field_of_every_run_config_has_a_schema_entry():
    for cls in (RunConfig, GrpoConfig, TrainConfig, DataConfig):
        assert {f.name for f in dataclasses.fields(cls)} <= set(schema(cls))
    assert problems(RunConfig("m", "d").to_dict(), RunConfig) == []
    assert problems(GrpoConfig("m", "p").to_dict(), GrpoConfig) == []


def test_read_config_file_names_file_line_and_column(tmp_path):
    path = tmp_path / "c.json"
    path.write_text('{"a": 1,\n "b": }')
    with pytest.raises(ConfigError, match=r"c\.json: invalid JSON: .* at line 2, column 7"):
        read_config_file(path)
    with pytest.raises(ConfigError, match=r"Cannot read the config file .*missing\.json: No such"):
        read_config_file(tmp_path / "missing.json")


# ---- random configs: a ConfigError or a config, nothing else ----------------------------------

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.sampled_from([0, 1, 2, -1, 10**400])
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8)
    | st.sampled_from(["cosine", "lora", "hybrid", "grpo", "sft", "exact", "clip", "mean-std"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                 max_size=3),
    max_leaves=6)


def section(cls) -> st.SearchStrategy:
    keys = [k for k in schema(cls)] + ["bogus"]
    return st.dictionaries(st.sampled_from(keys), JSON_VALUES, max_size=6)


RUN_DICTS = st.builds(lambda top, train, data: {**top, "train": train, "data_config": data},
                      section(RunConfig), section(TrainConfig), section(DataConfig)) | section(
    RunConfig)
GRPO_DICTS = st.builds(lambda top, train: {**top, "train": train}, section(GrpoConfig),
                       section(TrainConfig))


@fuzz
@fuzz_settings(150)
@given(RUN_DICTS, GRPO_DICTS)
def test_random_configs_validate_or_raise_config_error(run_dict, grpo_dict):
    for cls, d in ((RunConfig, {"model": "m", "data": "d", **run_dict}),
                   (GrpoConfig, {"model": "m", "prompts": "p", **grpo_dict})):
        try:
            cls.from_dict(d).validate()
        except ConfigError as e:
            assert e.message
        else:
            assert problems(d, cls) == []


# ---- JSON lines over the int digit limit; skipped rows named ----------------------------------

def test_a_json_integer_over_the_digit_limit_rejects_its_line(tmp_path):
    rejection = parse_line(3, ('{"text": "x", "n": ' + HUGE + "}").encode())
    assert isinstance(rejection, Rejection) and rejection.kind == INVALID_JSON
    assert rejection.line == 3 and "4300 digits" in rejection.reason
    weights = tmp_path / "w.jsonl"
    weights.write_text('{"id": "a", "reward": 1}\n{"id": "b", "reward": ' + HUGE + "}\n")
    with pytest.raises(DatasetError, match=r"w\.jsonl line 2: invalid JSON \(an integer longer"):
        read_weights_file(weights)
    weights.write_text('{"id": "a", "reward": 1' + "0" * 400 + "}\n")   # beyond float range
    with pytest.raises(DatasetError, match="line 1: the weight must be a finite number"):
        read_weights_file(weights)


def _dataset(tmp_path) -> Path:
    rows = ['{"text": "one two three four five six seven"}',
            '{"text": "big", "n": ' + HUGE + "}",
            '{"text": "one two three"}',
            '{"txt": "no text key"}',
            '{"text": "weighty", "weight": 1' + "0" * 400 + "}",
            '{"text": "four five six seven eight"}']
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return path


def test_lint_rejects_the_huge_integer_line_by_number(tmp_path, capsys):
    assert run_cli(["lint", str(_dataset(tmp_path)), "-m", MODEL, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    rejected = {r["line"]: r["reason"] for r in report["rejected"]}
    assert "4300 digits" in rejected[2] and "missing key" in rejected[4]
    assert "finite number" in rejected[5] and len(rejected) == 3


def test_train_names_the_lines_it_skips(tmp_path, capsys):
    assert run_cli(["train", "-m", MODEL, "-d", str(_dataset(tmp_path)), "--epochs", "0",
                    "--max-steps", "1", "--ctx", "16", "-o", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    line = next(l for l in out.splitlines() if "skipped" in l)
    assert line.startswith("log    skipped 3 rows: line 2 (invalid JSON: an integer longer than "
                           "4300 digits), line 4 (")
    assert "line 5 (" in line
    logged = [e["message"] for e in RunDir(tmp_path / "run").metrics() if e["type"] == "log"]
    assert any(m.startswith("skipped 3 rows: line 2") for m in logged)
