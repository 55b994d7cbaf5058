"""app.display_check: can this machine show the window? (issue 15). No display is needed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import app.display_check as dc
from app.__main__ import main

REPO = Path(__file__).resolve().parents[1]

# `ldd libqxcb.so` on a Debian 12 desktop without libxcb-icccm4 and libxcb-keysyms1 (shortened).
LDD_MISSING = """\
\tlinux-vdso.so.1 (0x00007f4944bc3000)
\tlibGL.so.1 => /lib/x86_64-linux-gnu/libGL.so.1 (0x00007f4944a65000)
\tlibxcb-cursor.so.0 => /lib/x86_64-linux-gnu/libxcb-cursor.so.0 (0x00007f4944a0b000)
\tlibxcb-icccm.so.4 => not found
\tlibxcb-keysyms.so.1 => not found
\tlibQt6XcbQpa.so.6 => /venv/PySide6/Qt/plugins/platforms/../../lib/libQt6XcbQpa.so.6 (0x00007f49)
\tlibxcb-icccm.so.4 => not found
\tlibxcb-keysyms.so.1 => not found
\tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f4942c1e000)
\t/lib64/ld-linux-x86-64.so.2 (0x00007f4944bc5000)
"""
LDD_OK = "\n".join(line.replace("=> not found", "=> /lib/x86_64-linux-gnu/x.so (0x1)")
                   for line in LDD_MISSING.splitlines())
DEBIAN = 'PRETTY_NAME="Debian GNU/Linux 12 (bookworm)"\nID=debian\n'
UBUNTU = 'NAME="Ubuntu"\nID=ubuntu\nID_LIKE=debian\n'
FEDORA = 'NAME="Fedora Linux"\nID=fedora\n'
ROCKY = 'NAME="Rocky Linux"\nID="rocky"\nID_LIKE="rhel centos fedora"\n'
ARCH = 'NAME="Arch Linux"\nID=arch\n'


@pytest.fixture
def fake_ldd(monkeypatch):
    """Answers `ldd` with the text put in holder["out"]; the plugins exist; Debian."""
    holder = {"out": LDD_MISSING}
    monkeypatch.setattr(dc, "plugin_path", lambda family: Path(f"/fake/libq{family}.so"))
    monkeypatch.setattr(dc, "run_ldd", lambda path: holder["out"])
    monkeypatch.setattr(dc, "_read_os_release", lambda: DEBIAN)
    return holder


def _clean_env(monkeypatch, **env):
    for name in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM", "XDG_SESSION_TYPE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def test_parse_ldd_lists_each_not_found_soname_once_in_order():
    assert dc.parse_ldd(LDD_MISSING) == ["libxcb-icccm.so.4", "libxcb-keysyms.so.1"]
    assert dc.parse_ldd(LDD_OK) == []
    assert dc.parse_ldd("") == []


@pytest.mark.parametrize("env, expected", [
    ({}, "xcb"),
    ({"DISPLAY": ":0"}, "xcb"),
    ({"QT_QPA_PLATFORM": "offscreen"}, "offscreen"),
    ({"QT_QPA_PLATFORM": "wayland;xcb"}, "wayland"),
    ({"QT_QPA_PLATFORM": "xcb:nograb"}, "xcb"),
    ({"QT_QPA_PLATFORM": "offscreen", "WAYLAND_DISPLAY": "wayland-0",
      "XDG_SESSION_TYPE": "wayland"}, "offscreen"),
    ({"WAYLAND_DISPLAY": "wayland-0", "XDG_SESSION_TYPE": "wayland"}, "wayland"),
    ({"WAYLAND_DISPLAY": "wayland-0", "XDG_SESSION_TYPE": "x11"}, "xcb"),
    ({"XDG_SESSION_TYPE": "wayland"}, "xcb"),
])
def test_platform_chosen_like_qt(monkeypatch, env, expected):
    monkeypatch.setattr(dc, "plugin_path", lambda family: Path("/fake/plugin.so"))
    _clean_env(monkeypatch, **env)
    assert dc.choose_platform() == expected


def test_wayland_needs_its_plugin(monkeypatch):
    monkeypatch.setattr(dc, "plugin_path", lambda family: None)
    _clean_env(monkeypatch, WAYLAND_DISPLAY="wayland-0", XDG_SESSION_TYPE="wayland")
    assert dc.choose_platform() == "xcb"


def test_not_linux_or_no_display_server_needed_is_not_checked(fake_ldd):
    assert dc.display_problem({}, "win32") is None
    assert dc.display_problem({}, "darwin") is None
    for platform in ("offscreen", "minimal", "vnc", "offscreen;xcb"):
        assert dc.display_problem({"QT_QPA_PLATFORM": platform}, "linux") is None


def test_no_display_message(fake_ldd):
    message = dc.display_problem({}, "linux")
    assert "no display found" in message and "DISPLAY is not set" in message
    assert "ssh -X" in message and "workbench --help" in message and "workbench train" in message
    wayland = dc.display_problem({"QT_QPA_PLATFORM": "wayland"}, "linux")
    assert "WAYLAND_DISPLAY is not set" in wayland


def test_later_platform_of_the_list_is_used_when_the_first_fails(fake_ldd):
    fake_ldd["out"] = LDD_OK
    assert dc.display_problem({"QT_QPA_PLATFORM": "wayland;xcb", "DISPLAY": ":0"}, "linux") is None
    assert dc.display_problem({"WAYLAND_DISPLAY": "w-0", "XDG_SESSION_TYPE": "wayland",
                               "DISPLAY": ":0"}, "linux") is None


@pytest.mark.parametrize("os_release, expected", [
    (DEBIAN, ["sudo apt-get install libxcb-icccm4 libxcb-keysyms1"]),
    (UBUNTU, ["sudo apt-get install libxcb-icccm4 libxcb-keysyms1"]),
    (FEDORA, ["sudo dnf install xcb-util-keysyms xcb-util-wm"]),
    (ROCKY, ["sudo dnf install xcb-util-keysyms xcb-util-wm"]),
    (ARCH, ["Debian/Ubuntu: sudo apt-get install libxcb-icccm4 libxcb-keysyms1",
            "Fedora/RHEL:   sudo dnf install xcb-util-keysyms xcb-util-wm"]),
    ("", ["Debian/Ubuntu: sudo apt-get install libxcb-icccm4 libxcb-keysyms1",
          "Fedora/RHEL:   sudo dnf install xcb-util-keysyms xcb-util-wm"]),
])
def test_install_command_for_the_distribution(os_release, expected):
    assert dc.install_commands(["libxcb-icccm.so.4", "libxcb-keysyms.so.1"], os_release) == expected


def test_packages_are_deduplicated_and_unknown_sonames_still_named():
    missing = ["libxcb-shape.so.0", "libxcb-randr.so.0", "libfoo.so.3"]
    assert dc.install_commands(missing, FEDORA) == ["sudo dnf install libxcb"]
    message = dc.missing_message("xcb", missing, FEDORA)
    assert "libfoo.so.3" in message and "package unknown" in message
    assert dc.install_commands(["libfoo.so.3"], DEBIAN) == []


def test_main_names_missing_libraries_and_exits_2(fake_ldd, monkeypatch, capsys):
    _clean_env(monkeypatch, DISPLAY=":99")
    assert main([]) == 2
    err = capsys.readouterr().err
    assert "libxcb-icccm.so.4" in err and "libxcb-keysyms.so.1" in err
    assert "sudo apt-get install libxcb-icccm4 libxcb-keysyms1" in err


def test_everything_present_passes(fake_ldd):
    fake_ldd["out"] = LDD_OK
    assert dc.display_problem({"DISPLAY": ":0"}, "linux") is None


def test_without_ldd_the_libraries_are_loaded_with_ctypes(fake_ldd, monkeypatch):
    fake_ldd["out"] = None

    def cdll(name):
        if name in ("libxcb-icccm.so.4", "libxcb-keysyms.so.1"):
            raise OSError(f"{name}: cannot open shared object file: No such file or directory")

    monkeypatch.setattr(dc.ctypes, "CDLL", cdll)
    assert dc.missing_libraries("xcb") == ["libxcb-icccm.so.4", "libxcb-keysyms.so.1"]
    assert "sudo apt-get install libxcb-icccm4 libxcb-keysyms1" in dc.display_problem(
        {"DISPLAY": ":0"}, "linux")


def test_every_probed_soname_has_packages():
    for family, sonames in dc.PROBED.items():
        assert set(sonames) <= set(dc.PACKAGES), family


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the check is Linux-only")
def test_real_plugin_on_this_machine():
    """ldd on PySide6's real libqxcb.so and loading the libraries with ctypes agree."""
    if dc.plugin_path("xcb") is None:
        pytest.skip("PySide6 ships no xcb plugin here")
    missing = dc.missing_libraries("xcb")
    problem = dc.display_problem({"DISPLAY": ":0"}, "linux")
    if missing:
        assert all(name in problem for name in missing)
    else:
        assert problem is None  # everything present: the check passes for xcb
    if dc.run_ldd(dc.plugin_path("xcb")) is not None:
        assert bool(missing) == bool(dc.probe(dc.PROBED["xcb"]))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="elsewhere the window opens")
def test_workbench_without_display_exits_2_with_the_message_and_no_qt():
    env = {k: v for k, v in os.environ.items()
           if k not in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM")}
    done = subprocess.run([sys.executable, "-m", "app"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "no display found" in done.stderr and "workbench --help" in done.stderr
    assert "Traceback" not in done.stderr
    code = ("import sys; from app.__main__ import main; rc = main([]); "
            "print(sorted(m for m in sys.modules if m.startswith('PySide6'))); sys.exit(rc)")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout.strip() == "[]"  # Qt was never loaded
