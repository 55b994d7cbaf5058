"""An evaluation as a queue job: the worker runs it and saves it with the run; a cancel saves
nothing; a bad config is refused."""

from __future__ import annotations

import pytest

from app.engine.errors import ConfigError
from app.engine.evaluation import job as eval_job
from app.engine.evaluation.store import read_evals
from app.engine.runs.queue import JobQueue
from app.engine.runs.rundir import RunDir
from app.engine.runs.worker import run_worker
from tests.conftest import DATA, GOLDEN


def _job(tmp_path, **kw):
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    (run / "config.json").write_text("{}")
    config = eval_job.EvalConfig(
        model=str(GOLDEN / "gemma3-f32.gguf"),
        tasks=[f"mc:{DATA}/eval/mc.bin", f"winogrande:{DATA}/eval/winogrande.csv"],
        targets=[{"label": "base"},
                 {"label": "lora", "adapter": str(GOLDEN / "gemma3-lora.gguf"), "scale": 0.5}],
        limit=5, **kw)
    return run, eval_job.new_eval_job(run, config)


def test_the_worker_runs_an_evaluation_and_saves_it_with_the_run(tmp_path):
    run, folder = _job(tmp_path)
    assert folder.parent == run / "evals"
    queue = JobQueue(tmp_path / "q.sqlite3")
    job_id = queue.add(folder)
    assert run_worker(queue, once=True, poll_s=0.01) == 1
    assert queue.get(job_id).state == "done", queue.get(job_id).error_message
    saved = read_evals(run)
    assert [(r["model"], r["task"]) for r in saved] == [
        ("base", "mc:mc.bin"), ("base", "winogrande:winogrande.csv"),
        ("lora", "mc:mc.bin"), ("lora", "winogrande:winogrande.csv")]
    assert saved == read_evals(folder) and all(r["n"] == 5 for r in saved)
    status = RunDir(folder).status()
    assert status["state"] == "done" and status["step"] == status["total_steps"] == 4
    assert any("lora winogrande" in e.get("message", "") for e in RunDir(folder).metrics())


class _Control:
    """A worker's JobControl as far as the runner uses it; a cancel after `after` questions."""

    def __init__(self, after: int):
        self.asked, self.after, self.events = 0, after, []

    def should_stop(self):
        self.asked += 1
        return "cancel" if self.asked > self.after else None

    def report(self, event):
        self.events.append(event)


def test_a_cancelled_evaluation_saves_nothing(tmp_path):
    run, folder = _job(tmp_path)
    assert eval_job.run_eval_job(RunDir(folder), _Control(after=3)) == "cancelled"
    assert not (run / "evals.jsonl").exists() and not (folder / "evals.jsonl").exists()


@pytest.mark.parametrize("change,match", [
    (dict(tasks=[]), "at least one task"),
    (dict(tasks=["nope:x"]), "Not a task"),
    (dict(targets=[{"label": "a"}, {"label": "a"}]), "its own label"),
    (dict(samples=0), "samples must be"),
    (dict(limit=True), "limit must be"),
])
def test_bad_configs_are_refused(change, match):
    raw = {"model": "m.gguf", "tasks": ["mc:x.bin"], **change}
    with pytest.raises(ConfigError, match=match):
        eval_job.EvalConfig.from_dict(raw)
    with pytest.raises(ConfigError, match="Unknown evaluation settings: colour"):
        eval_job.EvalConfig.from_dict({"model": "m", "tasks": ["mc:x"], "colour": 1})


def test_workbench_eval_queue_makes_the_job(tmp_path, capsys):
    from app.cli.main import run_cli

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("{}")
    queue = tmp_path / "q.sqlite3"
    assert run_cli(["eval", "-m", str(GOLDEN / "gemma3-f32.gguf"), "-t", f"mc:{DATA}/eval/mc.bin",
                    "--limit", "2", "--save", str(run), "--queue", str(queue)]) == 0
    folder = capsys.readouterr().out.split(": ", 1)[1].strip()
    config = eval_job.EvalConfig.from_dict(RunDir(folder).config())
    assert config.tasks == [f"mc:{DATA}/eval/mc.bin"] and config.limit == 2
    assert run_worker(JobQueue(queue), once=True, poll_s=0.01) == 1
    assert [r["task"] for r in read_evals(run)] == ["mc:mc.bin"]
    assert run_cli(["eval", "-m", "m.gguf", "-t", f"mc:{DATA}/eval/mc.bin", "--queue"]) == 2
    assert "--save RUN_DIR" in capsys.readouterr().err
