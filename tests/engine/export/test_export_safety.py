"""Exports never destroy a file the user did not name as disposable: an existing destination is
replaced only with --overwrite, the export's own inputs (the base model, the adapter, the run's
adapter.gguf and checkpoints) never, not even through a link; a failed export leaves what was
at the destination untouched. (issue 16) Issue 28: the run's own files and inputs, special
files, names too long, an export failing verification (moved aside), full and read-only
folders, file modes, damaged checkpoints."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import stat
from pathlib import Path

import pytest

from app.cli.main import run_cli
from app.engine.export import exporter as ex
from app.engine.errors import ConfigError
from app.engine.export.exporter import ExportSource, ExportTargetExists, check_export_destination
from app.engine.runtime.files import DiskFullError
from app.engine.model.lora import load_adapter
from app.engine.export.verify import Check
from app.engine.runs.destinations import MAX_NAME
from app.engine.runs.rundir import RunDir
from app.engine.training.checkpoints import save_checkpoint
from tests.conftest import GOLDEN

NAME = "qwen2"                   # the smallest golden model


def digest(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def tree(folder: Path) -> dict[str, str]:
    """Every file under `folder` (hidden ones too) with its hash."""
    return {str(p.relative_to(folder)): digest(p) for p in sorted(folder.rglob("*"))
            if p.is_file()}


@pytest.fixture
def base(tmp_path) -> Path:
    """A copy of a golden model: the tests may not touch the real one even if the guard fails."""
    path = tmp_path / "base.gguf"
    shutil.copy(GOLDEN / f"{NAME}-f32.gguf", path)
    return path


@pytest.fixture
def run(tmp_path, base) -> RunDir:
    """A finished-looking run of `base`: its final adapter.gguf, no checkpoint."""
    run = RunDir.create(tmp_path / "run", {"model": str(base), "data": "d.jsonl"})
    shutil.copy(GOLDEN / f"{NAME}-lora.gguf", run.path / "adapter.gguf")
    return run


def export_cli(*args) -> int:
    return run_cli(["export", *map(str, args), "--no-llamacpp"])


def adapter_args(run: RunDir, base: Path) -> list:
    return ["--adapter", run.path / "adapter.gguf", "--model", base]


def test_merging_over_the_base_model_is_refused(run, base, capsys):
    before = digest(base)
    for extra in ([], ["--overwrite"]):
        assert export_cli(*adapter_args(run, base), "--to", "merged", "--out", base, *extra) == 2
        err = capsys.readouterr().err
        assert f"error: Writing a merged export to {base} would write over the base model" in err
        assert "hint: The workbench never replaces a command's own inputs, not even when" in err
    assert digest(base) == before
    assert sorted(p.name for p in base.parent.iterdir()) == ["base.gguf", "run"]


def test_exporting_over_the_runs_adapter_is_refused(run, capsys):
    final = run.path / "adapter.gguf"
    before = digest(final)
    for extra in ([], ["--overwrite"]):
        assert export_cli(run.path, "--to", "gguf-lora", "--type", "q8_0", "--out", final,
                          *extra) == 2
        assert f"would write over the run's adapter.gguf ({final})" in capsys.readouterr().err
    assert digest(final) == before


@pytest.mark.parametrize("link", [os.symlink, os.link], ids=["symlink", "hard link"])
def test_a_link_to_the_base_model_is_refused(run, base, tmp_path, capsys, link):
    out = tmp_path / "linked.gguf"
    link(base, out)
    before = digest(base)
    assert export_cli(*adapter_args(run, base), "--to", "merged", "--out", out,
                      "--overwrite") == 2
    assert "would write over the base model" in capsys.readouterr().err
    assert digest(base) == before and os.path.samefile(out, base)


def test_an_existing_file_is_replaced_only_with_overwrite(run, base, tmp_path, capsys):
    out = tmp_path / "mine.gguf"
    out.write_bytes(b"the user's file")
    assert export_cli(*adapter_args(run, base), "--to", "gguf-lora", "--out", out) == 2
    err = capsys.readouterr().err
    assert f"error: {out} exists already." in err
    assert "hint: Pass --overwrite to replace it, or choose another path (--out)." in err
    assert out.read_bytes() == b"the user's file"
    assert export_cli(*adapter_args(run, base), "--to", "gguf-lora", "--out", out,
                      "--overwrite") == 0
    assert load_adapter(out).tensors


def test_the_default_destination_is_not_replaced_silently(run, capsys):
    exported = run.exports_dir / "adapter-f16.gguf"
    assert export_cli(run.path, "--to", "gguf-lora", "--type", "f16") == 0
    first = digest(exported)
    assert export_cli(run.path, "--to", "gguf-lora", "--type", "f16", "--scale", "0.5") == 2
    assert f"{exported} exists already" in capsys.readouterr().err
    assert digest(exported) == first
    assert export_cli(run.path, "--to", "gguf-lora", "--type", "f16", "--scale", "0.5",
                      "--overwrite") == 0
    assert digest(exported) != first


@pytest.mark.parametrize("to", ["peft", "ollama"])
def test_folder_exports(run, base, tmp_path, capsys, to):
    out = tmp_path / to
    out.mkdir()                                      # an empty folder holds nothing to lose
    assert export_cli(*adapter_args(run, base), "--to", to, "--out", out) == 0
    first = tree(out)
    assert export_cli(*adapter_args(run, base), "--to", to, "--out", out, "--scale", "2") == 2
    assert f"{out} exists already" in capsys.readouterr().err
    assert tree(out) == first
    assert export_cli(*adapter_args(run, base), "--to", to, "--out", out, "--scale", "2",
                      "--overwrite") == 0
    assert tree(out).keys() == first.keys() and tree(out) != first
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    (out / "notes.txt").write_text("mine")           # replacing the folder would delete it
    assert export_cli(*adapter_args(run, base), "--to", to, "--out", out, "--overwrite") == 2
    assert "holds files a" in capsys.readouterr().err and (out / "notes.txt").is_file()


def test_a_folder_export_never_replaces_a_folder_holding_an_input(run, base, tmp_path, capsys):
    out = tmp_path / "ollama"
    assert export_cli(*adapter_args(run, base), "--to", "ollama", "--out", out) == 0
    adapter = out / "adapter.gguf"                   # the exported adapter, exported again
    before = tree(out)
    assert export_cli("--adapter", adapter, "--model", base, "--to", "ollama", "--out", out,
                      "--overwrite") == 2
    assert f"would write over the adapter ({adapter})" in capsys.readouterr().err
    assert tree(out) == before
    assert export_cli(run.path, "--to", "peft", "--out", run.path, "--overwrite") == 2
    assert "would write over the run's" in capsys.readouterr().err


def test_a_file_where_a_folder_goes_and_the_reverse(run, tmp_path):
    source = ExportSource(str(run.path / "adapter.gguf"), run_dir=str(run.path))
    a_file, a_folder = tmp_path / "f.gguf", tmp_path / "folder"
    a_file.write_bytes(b"x")
    (a_folder / "sub").mkdir(parents=True)
    with pytest.raises(ConfigError, match="is a file, and a peft export is a folder"):
        check_export_destination(source, "peft", a_file, overwrite=True)
    with pytest.raises(ConfigError, match="is a folder, and a merged export is one regular file"):
        check_export_destination(source, "merged", a_folder, overwrite=True)


def test_the_runs_checkpoints_are_inputs(run, base):
    step = run.checkpoints_dir / "step-2"
    step.mkdir()
    (step / "state.npz").write_bytes(b"state")
    source = ExportSource(str(base), run_dir=str(run.path), checkpoint=str(step))
    for out, to in ((step / "state.npz", "merged"), (step, "peft"), (step / "new.gguf", "merged"),
                    (run.checkpoints_dir, "ollama"), (run.path, "peft")):
        with pytest.raises(ConfigError, match="would write over the (checkpoint|run's)"):
            check_export_destination(source, to, out, overwrite=True)
    check_export_destination(source, "merged", run.exports_dir / "merged.gguf")
    with pytest.raises(ConfigError, match="would write over the run's config.json"):
        check_export_destination(source, "merged", run.path / "config.json", overwrite=True)


def test_a_failed_export_leaves_the_existing_file(run, base, tmp_path, monkeypatch):
    import gguf

    out = tmp_path / "merged.gguf"
    out.write_bytes(b"an earlier export")

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", disk_full)
    source = ex.source_from_adapter(run.path / "adapter.gguf", base)
    with pytest.raises(DiskFullError, match=f"no space left in {tmp_path} to write merged.gguf"):
        ex.export(source, "merged", out, llamacpp=False, overwrite=True)
    assert out.read_bytes() == b"an earlier export"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base.gguf", "merged.gguf", "run"]


def test_a_failed_folder_export_leaves_the_existing_folder(run, base, tmp_path, monkeypatch):
    out = tmp_path / "ollama"
    assert export_cli(*adapter_args(run, base), "--to", "ollama", "--out", out) == 0
    before = tree(out)

    def broken(*args, **kwargs):                     # after the adapter has been written
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(ex, "modelfile_text", broken)
    source = ex.source_from_adapter(run.path / "adapter.gguf", base)
    with pytest.raises(DiskFullError, match="no space left in"):
        ex.export(source, "ollama", out, llamacpp=False, scale=2.0, overwrite=True)
    assert tree(out) == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


# ---- issue 28: one rule for every writer -------------------------------------------------------

def test_a_runs_config_and_dataset_are_never_replaced(tmp_path, base, capsys):
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "the run\'s data"}\n')
    run = RunDir.create(tmp_path / "run2", {"model": str(base), "data": str(data)})
    shutil.copy(GOLDEN / f"{NAME}-lora.gguf", run.path / "adapter.gguf")
    for out, what in ((run.config_path, "the run's config.json"), (data, "the run's dataset")):
        before = digest(out)
        assert export_cli(run.path, "--to", "gguf-lora", "--out", out, "--overwrite") == 2
        assert f"would write over {what} ({out})" in capsys.readouterr().err
        assert digest(out) == before
    other = RunDir.create(tmp_path / "other", {"model": str(base), "data": str(data)})
    assert export_cli(run.path, "--to", "gguf-lora", "--out", other.config_path,
                      "--overwrite") == 2                  # another run's own files too
    assert f"would write over config.json of the run {other.path}" in capsys.readouterr().err


def test_only_a_regular_file_is_replaced(run, base, tmp_path, capsys):
    fifo = tmp_path / "fifo.gguf"
    os.mkfifo(fifo)
    device = tmp_path / "full.gguf"
    device.symlink_to("/dev/full" if os.path.exists("/dev/full") else "/dev/null")
    for out, kind in ((fifo, "a FIFO"), (device, "a character device")):
        assert export_cli(*adapter_args(run, base), "--to", "gguf-lora", "--out", out,
                          "--overwrite") == 2
        assert f"error: {out} is {kind}, and a gguf-lora export is one regular file." in \
               capsys.readouterr().err
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and device.is_symlink()


def test_a_name_too_long_for_the_files_beside_it(run, base, tmp_path, capsys):
    out = tmp_path / ("a" * 240 + ".gguf")                   # 245 bytes: its .verify.json, 257
    assert export_cli(*adapter_args(run, base), "--to", "gguf-lora", "--out", out) == 2
    err = capsys.readouterr().err
    assert f"is 245 bytes long; a gguf-lora export may have at most {MAX_NAME}" in err
    assert "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base.gguf", "run"]


def test_a_failed_verification_is_moved_aside_and_the_earlier_export_kept(run, base, tmp_path,
                                                                          capsys, monkeypatch):
    def planted_failure(path, *args, **kw):
        report = args[4] if len(args) > 4 else kw["report"]
        report.add(Check("tensors", False, "planted failure"))
    for to, verifier, out, aside in (
            ("gguf-lora", "verify_gguf_lora", tmp_path / "a.gguf",
             tmp_path / "a.failed-verification.gguf"),
            ("peft", "verify_peft", tmp_path / "peft", tmp_path / "peft.failed-verification")):
        assert export_cli(*adapter_args(run, base), "--to", to, "--out", out) == 0
        good, good_report = tree(tmp_path), Path(f"{out}.verify.json").read_text()
        with monkeypatch.context() as m:
            m.setattr(ex, verifier, planted_failure)
            assert export_cli(*adapter_args(run, base), "--to", to, "--out", out, "--scale",
                              "2", "--overwrite") == 3
        captured = capsys.readouterr()
        assert (f"error: the export failed verification, so it was moved aside to {aside} "
                f"instead of {out}; do not use it." in captured.err)
        assert f"moved aside: it failed verification, so it was not left at {out}" in captured.out
        assert {k: v for k, v in tree(tmp_path).items() if k in good} == good   # kept intact
        assert Path(f"{out}.verify.json").read_text() == good_report
        report = json.loads(Path(f"{aside}.verify.json").read_text())
        assert report["ok"] is False and report["path"] == str(aside)
        assert all(f.startswith(str(aside)) for f in report["files"])
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


@pytest.mark.parametrize("code, message", [
    (errno.ENOSPC, "The disk is full: no space left in {folder} to write merged.gguf."),
    (errno.EROFS, "{folder} is read-only: could not write merged.gguf.")])
def test_a_full_disk_or_a_read_only_folder_under_a_merged_export(run, base, tmp_path, capsys,
                                                                  monkeypatch, code, message):
    import gguf

    def failing(*args, **kwargs):
        raise OSError(code, os.strerror(code))
    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", failing)
    folder = tmp_path / "exports"
    assert export_cli(*adapter_args(run, base), "--to", "merged", "--out",
                      folder / "merged.gguf") == 2
    err = capsys.readouterr().err
    assert f"error: {message.format(folder=folder)}" in err and "Traceback" not in err
    assert list(folder.iterdir()) == []


def test_every_export_file_is_created_like_any_other_file(run, base, tmp_path):
    """0666 less the umask: the Modelfile, the PEFT config and the reports were 0600."""
    previous = os.umask(0o022)
    try:
        for to in ("gguf-lora", "peft", "ollama"):
            assert export_cli(*adapter_args(run, base), "--to", to, "--out",
                              tmp_path / "out" / to) == 0
    finally:
        os.umask(previous)
    modes = {p.name: oct(stat.S_IMODE(p.stat().st_mode))
             for p in (tmp_path / "out").rglob("*") if p.is_file()}
    assert {"Modelfile", "adapter_config.json", "adapter_model.safetensors", "adapter.gguf",
            "gguf-lora", "peft.verify.json", "ollama.verify.json"} <= set(modes)
    assert set(modes.values()) == {"0o644"}, modes


def test_a_damaged_newest_checkpoint_falls_back_to_the_newest_intact_one(run, base, tmp_path,
                                                                        capsys):
    lora = load_adapter(run.path / "adapter.gguf")
    trainable = {f"{name}.{half}": array for name, (a, b) in lora.tensors.items()
                 for half, array in (("lora_a", a), ("lora_b", b))}
    for step in (1, 2):
        save_checkpoint(run.checkpoints_dir, step, {"trainable": trainable})
    (run.checkpoints_dir / "step-2" / "arrays.npz").write_bytes(b"damaged")
    out = tmp_path / "a.gguf"
    assert export_cli(run.path, "--to", "gguf-lora", "--out", out) == 0
    captured = capsys.readouterr()
    assert "exporting the final checkpoint, step 1 (no evaluation chose a best one)" in captured.err
    assert ("warning: checkpoint step-2 is damaged (arrays.npz does not match its checksum); "
            "exporting step-1, the newest intact one" in captured.out)
    assert (run.checkpoints_dir / "step-2").is_dir()     # export reads a run, never renames in it
    assert export_cli(run.path, "--to", "gguf-lora", "--checkpoint", "2", "--out",
                      tmp_path / "b.gguf") == 2
    err = capsys.readouterr().err
    assert "step-2 is damaged (arrays.npz does not match its checksum)" in err
    assert (f"hint: Export another checkpoint: workbench export {run.path} --checkpoint STEP "
            f"(the newest intact one is step 1; see {run.checkpoints_dir})." in err)
    assert "resume" not in err


def test_a_name_at_the_limit_is_exported_with_its_report(run, base, tmp_path, capsys):
    """Probe finding 11: a name of exactly MAX_NAME bytes was refused, the message quoting its
    report's length ("is 227 bytes long; its verification report may have at most 215")."""
    out = tmp_path / ("b" * (MAX_NAME - 5) + ".gguf")
    assert export_cli(*adapter_args(run, base), "--to", "gguf-lora", "--out", out) == 0, \
        capsys.readouterr().err
    assert out.is_file() and out.with_name(out.name + ".verify.json").is_file()
