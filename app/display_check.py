"""Can this machine show the window? Asked before Qt is loaded.

On Linux, when Qt cannot load its platform plugin it aborts the process (exit 134, a core dump)
and its message often names the wrong library: "xcb-cursor0 or libxcb-cursor0 is needed" was
printed on a desktop where libxcb-icccm.so.4 and libxcb-keysyms.so.1 were the ones missing
(issue 15). `display_problem()` answers first, without importing any Qt module or creating any
Qt object:

- it picks the platform the way Qt 6 does: QT_QPA_PLATFORM when set (its first entry; a later
  one of "wayland;xcb" when the first fails), else wayland (then xcb) when WAYLAND_DISPLAY is
  set, XDG_SESSION_TYPE is "wayland" and PySide6 ships the wayland plugin, else xcb. Other
  platforms (offscreen, minimal, vnc, eglfs ...) and other operating systems are not checked;
- no display for that platform (DISPLAY or WAYLAND_DISPLAY unset): says so and points to the CLI;
- otherwise lists the shared libraries the platform plugin (libqxcb.so or libqwayland.so) cannot
  find, with `ldd` (which follows the plugin into libQt6XcbQpa and libQt6Gui), or by loading a
  known list of libraries with ctypes where there is no ldd, and names the packages and the
  install command for this distribution.

It returns the message to print, or None when the window can open.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

# soname -> (Debian/Ubuntu package, Fedora/RHEL package). What PySide6 6.11's libqxcb.so,
# libQt6XcbQpa.so.6, libQt6Gui.so.6 and libqwayland.so link, as `ldd` lists them.
PACKAGES: dict[str, tuple[str, str]] = {
    "libxcb-cursor.so.0": ("libxcb-cursor0", "xcb-util-cursor"),
    "libxcb-icccm.so.4": ("libxcb-icccm4", "xcb-util-wm"),
    "libxcb-keysyms.so.1": ("libxcb-keysyms1", "xcb-util-keysyms"),
    "libxcb-image.so.0": ("libxcb-image0", "xcb-util-image"),
    "libxcb-render-util.so.0": ("libxcb-render-util0", "xcb-util-renderutil"),
    "libxcb-util.so.1": ("libxcb-util1", "xcb-util"),
    "libxcb-xkb.so.1": ("libxcb-xkb1", "libxcb"),
    "libxcb-shape.so.0": ("libxcb-shape0", "libxcb"),
    "libxcb-randr.so.0": ("libxcb-randr0", "libxcb"),
    "libxcb-xinerama.so.0": ("libxcb-xinerama0", "libxcb"),
    "libxcb-sync.so.1": ("libxcb-sync1", "libxcb"),
    "libxcb-xfixes.so.0": ("libxcb-xfixes0", "libxcb"),
    "libxcb-render.so.0": ("libxcb-render0", "libxcb"),
    "libxcb-shm.so.0": ("libxcb-shm0", "libxcb"),
    "libxcb-xinput.so.0": ("libxcb-xinput0", "libxcb"),
    "libxcb-glx.so.0": ("libxcb-glx0", "libxcb"),
    "libxcb.so.1": ("libxcb1", "libxcb"),
    "libxkbcommon-x11.so.0": ("libxkbcommon-x11-0", "libxkbcommon-x11"),
    "libxkbcommon.so.0": ("libxkbcommon0", "libxkbcommon"),
    "libX11-xcb.so.1": ("libx11-xcb1", "libX11-xcb"),
    "libX11.so.6": ("libx11-6", "libX11"),
    "libXau.so.6": ("libxau6", "libXau"),
    "libXdmcp.so.6": ("libxdmcp6", "libXdmcp"),
    "libEGL.so.1": ("libegl1", "libglvnd-egl"),
    "libGL.so.1": ("libgl1", "libglvnd-glx"),
    "libGLX.so.0": ("libglx0", "libglvnd-glx"),
    "libGLdispatch.so.0": ("libglvnd0", "libglvnd"),
    "libOpenGL.so.0": ("libopengl0", "libglvnd-opengl"),
    "libfontconfig.so.1": ("libfontconfig1", "fontconfig"),
    "libfreetype.so.6": ("libfreetype6", "freetype"),
    "libpng16.so.16": ("libpng16-16", "libpng"),
    "libdbus-1.so.3": ("libdbus-1-3", "dbus-libs"),
    "libSM.so.6": ("libsm6", "libSM"),
    "libICE.so.6": ("libice6", "libICE"),
    "libglib-2.0.so.0": ("libglib2.0-0", "glib2"),
    "libgthread-2.0.so.0": ("libglib2.0-0", "glib2"),
    "libwayland-client.so.0": ("libwayland-client0", "libwayland-client"),
    "libwayland-cursor.so.0": ("libwayland-cursor0", "libwayland-cursor"),
    "libwayland-egl.so.1": ("libwayland-egl1", "libwayland-egl"),
}

# The platform plugin file of each checked platform family, newest name first.
PLUGINS = {"xcb": ("libqxcb.so",), "wayland": ("libqwayland.so", "libqwayland-generic.so")}
# Without ldd: the libraries to try to load, those PySide6 6.11's plugins link (through
# libQt6XcbQpa and libQt6Gui for xcb). Older Qt versions also linked xinerama, SM, ICE ...
_GUI = ["libxkbcommon.so.0", "libEGL.so.1", "libGL.so.1", "libfontconfig.so.1",
        "libfreetype.so.6", "libglib-2.0.so.0", "libdbus-1.so.3", "libX11.so.6", "libxcb.so.1"]
PROBED = {
    "xcb": _GUI + ["libxkbcommon-x11.so.0", "libxcb-cursor.so.0", "libxcb-icccm.so.4",
                   "libxcb-util.so.1", "libxcb-image.so.0", "libxcb-keysyms.so.1",
                   "libxcb-randr.so.0", "libxcb-render-util.so.0", "libxcb-shm.so.0",
                   "libxcb-sync.so.1", "libxcb-xfixes.so.0", "libxcb-render.so.0",
                   "libxcb-shape.so.0", "libxcb-xkb.so.1", "libX11-xcb.so.1"],
    "wayland": _GUI + ["libwayland-client.so.0", "libwayland-cursor.so.0"],
}
_NOT_FOUND = re.compile(r"^\s*(\S+)\s+=>\s+not found\s*$")


def plugin_path(family: str) -> Path | None:
    """PySide6's platform plugin for `family` ("xcb" or "wayland"), None when absent."""
    spec = importlib.util.find_spec("PySide6")  # locates the package, imports no Qt module
    if spec is None or not spec.submodule_search_locations:
        return None
    platforms = Path(list(spec.submodule_search_locations)[0]) / "Qt" / "plugins" / "platforms"
    for name in PLUGINS[family]:
        if (platforms / name).is_file():
            return platforms / name
    return None


def candidate_platforms(env: Mapping[str, str] = os.environ) -> list[str]:
    """The Qt platforms Qt 6 tries on Linux, in order: ["xcb"], ["wayland", "xcb"], ..."""
    requested = [entry.split(":")[0].strip()  # "xcb:option=value" names the platform "xcb"
                 for entry in env.get("QT_QPA_PLATFORM", "").split(";")]
    if any(requested):
        return [name for name in requested if name]
    if (env.get("WAYLAND_DISPLAY") and env.get("XDG_SESSION_TYPE") == "wayland"
            and plugin_path("wayland") is not None):
        return ["wayland", "xcb"]
    return ["xcb"]


def choose_platform(env: Mapping[str, str] = os.environ) -> str:
    """The Qt platform Qt 6 tries first on Linux, e.g. "xcb", "wayland", "offscreen"."""
    return candidate_platforms(env)[0]


def parse_ldd(output: str) -> list[str]:
    """The sonames `ldd` reports as "not found", in order, each once."""
    missing: list[str] = []
    for line in output.splitlines():
        match = _NOT_FOUND.match(line)
        if match and match.group(1) not in missing:
            missing.append(match.group(1))
    return missing


def run_ldd(path: Path) -> str | None:
    """`ldd path`'s output, None when this machine has no ldd."""
    ldd = shutil.which("ldd")
    if ldd is None:
        return None
    try:
        return subprocess.run([ldd, str(path)], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None  # an ldd that cannot run: load the libraries instead


def probe(sonames: list[str]) -> list[str]:
    """The sonames ctypes cannot load (the fallback where there is no ldd)."""
    missing = []
    for name in sonames:
        try:
            ctypes.CDLL(name)
        except OSError:
            missing.append(name)
    return missing


def missing_libraries(family: str) -> list[str]:
    """The shared libraries the `family` platform plugin needs and this machine lacks."""
    plugin = plugin_path(family)
    if plugin is None:
        return []  # no PySide6 or no plugin: nothing this check can say; Qt will report it
    output = run_ldd(plugin)
    return probe(PROBED[family]) if output is None else parse_ldd(output)


def distro_family(os_release: str) -> str:
    """"debian", "fedora" or "" from the text of /etc/os-release (its ID and ID_LIKE)."""
    ids: list[str] = []
    for line in os_release.splitlines():
        key, _, value = line.partition("=")
        if key.strip() in ("ID", "ID_LIKE"):
            ids += value.strip().strip("\"'").lower().split()
    if any(i in ("debian", "ubuntu") for i in ids):
        return "debian"
    if any(i in ("fedora", "rhel", "centos") for i in ids):
        return "fedora"
    return ""


def install_commands(missing: list[str], os_release: str) -> list[str]:
    """The install command(s) for the missing sonames: this distribution's, or both."""
    deb = sorted({PACKAGES[n][0] for n in missing if n in PACKAGES})
    rpm = sorted({PACKAGES[n][1] for n in missing if n in PACKAGES})
    if not deb:
        return []  # only sonames the table does not know: listed by name, no command
    lines = {"debian": f"sudo apt-get install {' '.join(deb)}",
             "fedora": f"sudo dnf install {' '.join(rpm)}"}
    family = distro_family(os_release)
    return [lines[family]] if family else [f"Debian/Ubuntu: {lines['debian']}",
                                           f"Fedora/RHEL:   {lines['fedora']}"]


def _read_os_release() -> str:
    for path in ("/etc/os-release", "/usr/lib/os-release"):
        try:
            return Path(path).read_text(errors="replace")
        except OSError:
            pass
    return ""


def no_display_message(family: str) -> str:
    variable = "DISPLAY" if family == "xcb" else "WAYLAND_DISPLAY"
    return (f"workbench: no display found ({variable} is not set), so the window cannot open.\n"
            "The window needs a desktop session (or `ssh -X` from one).\n"
            "Everything also works headless from the command line: see `workbench --help`,\n"
            "e.g. `workbench train -m MODEL.gguf -d DATA.jsonl -o runs/first`.")


def missing_message(family: str, missing: list[str], os_release: str) -> str:
    lines = [f"workbench: Qt's {family} platform plugin cannot load: "
             "these system libraries are missing:"]
    for name in missing:
        if name in PACKAGES:
            deb, rpm = PACKAGES[name]
            lines.append(f"  {name:26} (Debian/Ubuntu: {deb}, Fedora: {rpm})")
        else:
            lines.append(f"  {name:26} (package unknown: search your distribution for it)")
    commands = install_commands(missing, os_release)
    if commands:
        lines.append("Install them with:")
        lines += [f"  {command}" for command in commands]
    return "\n".join(lines)


def platform_problem(name: str, env: Mapping[str, str] = os.environ) -> str | None:
    """Why Qt's platform `name` cannot open a window here, None when it can (or is not checked)."""
    family = "xcb" if name == "xcb" else "wayland" if name.startswith("wayland") else None
    if family is None:
        return None  # offscreen, minimal, vnc, eglfs ...: no display server to find
    if not env.get("DISPLAY" if family == "xcb" else "WAYLAND_DISPLAY"):
        return no_display_message(family)
    missing = missing_libraries(family)
    return missing_message(family, missing, _read_os_release()) if missing else None


def display_problem(env: Mapping[str, str] = os.environ,
                    platform: str = sys.platform) -> str | None:
    """Why the window cannot open on this machine, or None when it can (or it is not Linux).

    Like Qt, a later platform of the list ("wayland;xcb") is used when the first one fails;
    the message is the first platform's.
    """
    if not platform.startswith("linux"):
        return None
    first = None
    for name in candidate_platforms(env):
        problem = platform_problem(name, env)
        if problem is None:
            return None
        first = first or problem
    return first
