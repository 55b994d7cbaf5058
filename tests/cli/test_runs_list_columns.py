"""`runs list` columns line up when a run's name has a byte that is not UTF-8 (probe finding
12): the name is printed escaped (\\udcff, six characters for one), so it is padded by the
width it has as printed."""

from __future__ import annotations

from app.cli.main import _print_table


def test_an_escaped_name_is_padded_by_its_printed_width(capsys):
    _print_table(["NAME", "STATUS"], [["run\udcff", "done"], ["plain", "failed"]])
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("run\\udcff  done")
    assert [line.index(word) for line, word in zip(lines, ["STATUS", "done", "failed"])] \
        == [len("run\\udcff  ")] * 3
