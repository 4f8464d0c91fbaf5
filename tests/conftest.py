"""Shared fixtures: tiny random models built from configs (no downloads) and the embedded model."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")      # before huggingface_hub reads it at import time

import pytest  # noqa: E402
import torch  # noqa: E402
#: Torch threads per test process: the machine's cores (at most 2), shared out among pytest-xdist's
#: workers (``-n``), so parallel workers do not oversubscribe the cores. ``OMP_NUM_THREADS`` carries
#: the share to what a test starts: ``run.py`` subprocesses and the in-process ``kvnotes`` commands'
#: ``--threads`` default (:func:`kvnotes.cli.default_threads`). A command on two threads beside the
#: other worker's one ran 5-10x slower (OpenMP's waiting threads spin on a busy core).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
THREADS = max(1, min(2, os.cpu_count() or 1) // _WORKERS)
os.environ["OMP_NUM_THREADS"] = str(THREADS)
torch.set_num_threads(THREADS)

from tests.helpers import ARCHS, build_tiny, fruit_scenario  # noqa: E402
from kvnotes.harness.registry import register_schemas  # noqa: E402

register_schemas()          # the probes' Config dataclasses, for every test that composes with Hydra

#: Fixtures shared across test folders, reaching every test without an import: the planted-mechanism
#: models (tests/planted.py) and the embedded models' recall pairs (tests/recall.py).
pytest_plugins = ["tests.planted", "tests.recall"]

#: Fixtures that load the embedded model (directly or through another fixture): their tests are
#: marked ``embedded`` automatically, so ``pytest -m "not embedded"`` is the fast lane.
EMBEDDED_FIXTURES = {"smol", "gemma", "sweep"}


def _lane_lines() -> list[str]:
    """The zoo conformance lane's lines written in this process (tests/lanes/test_zoo.py)."""
    import sys

    lane = sys.modules.get("test_zoo") or sys.modules.get("tests.lanes.test_zoo")
    return list(getattr(lane, "LANE_LINES", []))


#: Lane lines the pytest-xdist workers handed back (:func:`pytest_testnodedown`).
_WORKER_LANE_LINES: list[str] = []


def pytest_sessionfinish(session):
    """A pytest-xdist worker hands its lane lines to the controller."""
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["lane_lines"] = _lane_lines()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """The controller collects a finished worker's lane lines (pytest-xdist)."""
    _WORKER_LANE_LINES.extend(getattr(node, "workeroutput", {}).get("lane_lines", []))


def pytest_terminal_summary(terminalreporter):
    """The zoo conformance lane's one line per zoo entry (tests/lanes/test_zoo.py), in one process or
    gathered from the workers."""
    for line in sorted(_lane_lines() + _WORKER_LANE_LINES):
        terminalreporter.write_line(line)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if EMBEDDED_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.embedded)


@pytest.fixture(scope="session", params=ARCHS)
def tiny(request):
    """A tiny random model of each architecture (fp32, CPU)."""
    return build_tiny(request.param)


@pytest.fixture(scope="session")
def smol():
    """The embedded SmolLM2-135M-Instruct bundle (materialised once into the kvnotes cache)."""
    from omegaconf import OmegaConf

    from kvnotes.models.loading import load_model

    cfg = OmegaConf.load(os.path.join(os.path.dirname(__file__), "..", "conf", "model", "smollm2-135m.yaml"))
    return load_model(cfg, "cpu")


@pytest.fixture(scope="session")
def gemma():
    """The embedded Gemma-3-270M bundle (assembled and materialised once into the kvnotes cache)."""
    from omegaconf import OmegaConf

    from kvnotes.models.loading import load_model

    cfg = OmegaConf.load(os.path.join(os.path.dirname(__file__), "..", "conf", "model", "gemma-3-270m.yaml"))
    return load_model(cfg, "cpu")


@pytest.fixture(scope="session")
def sweep(tmp_path_factory):
    """A new scenario file (new domain, same schema) swept through two probes in one ``run.py -m`` run on the
    embedded SmolLM2 (shared by the command-line tests and the report's browser test)."""
    from tests.cli.test_cli import run

    tmp = tmp_path_factory.mktemp("sweep")
    new = fruit_scenario(tmp / "fruit.yaml")
    out = tmp / "runs"
    proc = run("-m", "probe=blast_radius,screen", f"scenario.paths=[{new}]", "scenario.n_instances=3",
               f"out_root={out}", "probe.progress=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc
