"""Shared fixtures: a real etcd server, a job id, agents as real processes.

Fixtures and hooks only: the helpers (condition waits with deadlines, the Agent process wrapper,
worker environments, CLI runners) are imported from the ``helpers`` package (tests/helpers/).

GPUs: the suite simulates several nodes on one host, each agent running workers with LOCAL_RANK 0.
On a GPU host those agents would pick NCCL and bind every node's worker to ``cuda:0`` ("Duplicate GPU
detected"). So every test runs with ``CUDA_VISIBLE_DEVICES=""`` in ``os.environ`` — set before its
setup (module- and session-scoped fixtures it starts included) and restored after its teardown —
and everything it starts inherits it: agents, workers, ``torch.multiprocessing`` children, scripts,
in-process CLI calls (workers train on the CPU over gloo). A test that passes its own
``CUDA_VISIBLE_DEVICES`` to a child keeps it. Tests marked ``@pytest.mark.gpu`` see the host's GPUs
(and give each simulated node its own device); they skip where the GPUs they need are absent.
The pytest process's own CUDA view is fixed with the host's GPUs before any test runs when gpu
tests were collected (``torch.cuda`` reads the variable once, at its first use).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import uuid
from functools import cache
from pathlib import Path
from typing import Callable, Iterator, List, Optional

import pytest

from elasticrun.rendezvous.protocol import Rendezvous
from elasticrun.store.client import EtcdStore, connect
from elasticrun.store.server import EtcdServer

from helpers.fake_store import FakeStore
from helpers.procs import Agent

# Tests stop child processes with SIGINT/SIGQUIT. A shell that starts the suite in the
# background (`cmd &` without job control) makes both signals ignored, and an ignored signal
# stays ignored across exec: restore the defaults so every child starts as from a terminal.
for _sig in (signal.SIGINT, signal.SIGQUIT):
    if signal.getsignal(_sig) == signal.SIG_IGN:
        signal.signal(_sig, signal.default_int_handler if _sig == signal.SIGINT else signal.SIG_DFL)

HIDE_GPUS = "CUDA_VISIBLE_DEVICES"


SHARED_FIXTURE = re.compile(r"scope=[\"'](module|class)[\"']")
GPU_TESTS = re.compile(r"pytest\.mark\.gpu\b")
HAS_GPUS = os.path.exists("/dev/nvidiactl")  # an NVIDIA driver: the gpu tests will run, not skip


@cache
def _scope_of_file(path: Path) -> Optional[str]:
    """The worker group of a whole test file under ``-n``, or None (its tests go anywhere): the file when
    it defines a module- or class-scoped fixture (an expensive shared setup: a whole chaos run, a
    torchrun/elasticrun pair, a secured etcd, set up once instead of once per worker); on a GPU host,
    one group for every file with ``gpu`` tests (they must not share the GPUs with each other)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return None
    if HAS_GPUS and GPU_TESTS.search(text):
        return "gpu tests"
    return str(path) if SHARED_FIXTURE.search(text) else None


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """``pytest -n N`` (README: the suite in three processes): tests are sent to the workers one by one as they free up,
    except the groups :func:`_scope_of_file` names, each sent to one worker. (pytest-xdist's own
    ``xdist_group`` marks cannot do this on pytest >= 9.2: xdist renames the test ids through an
    attribute pytest no longer reads.)"""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SharedFixtureScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _scope_of_file(config.rootpath / nodeid.split("::", 1)[0]) or nodeid

    return SharedFixtureScheduling(config, log)


#: The project's own code that the suite's processes import (agents, workers, CLI calls, scripts).
COMPILED_TREES = ("elasticrun", "examples", "scripts", "tests/scripts", "tests/helpers")


def pytest_sessionstart(session: pytest.Session) -> None:
    """Compile the project's modules to bytecode once, before any test starts a process.

    The suite starts hundreds of Python processes that import the package; where the environment says
    ``PYTHONDONTWRITEBYTECODE`` (some CI images do), none would keep its compiled modules and each would
    compile them again (~0.3 CPU-s an agent). Python reads existing bytecode whatever that variable says.
    """
    import compileall

    for tree in COMPILED_TREES:
        path = session.config.rootpath / tree
        if path.is_dir():
            compileall.compile_dir(str(path), quiet=2, workers=1)


def pytest_collection_modifyitems(items: List[pytest.Item]) -> None:
    """Under ``-n``: tests that start processes or etcd (``integration``) first, the in-process ones last,
    so that the workers end together, the short tests filling the gap the last long one leaves."""
    if os.environ.get("PYTEST_XDIST_WORKER"):  # every worker collects, and sorts alike
        items.sort(key=lambda item: item.get_closest_marker("integration") is None)


def pytest_collection_finish(session: pytest.Session) -> None:
    """With gpu tests to run, let torch.cuda see the host's GPUs first (it reads the variable once)."""
    if any(item.get_closest_marker("gpu") for item in session.items):
        import torch

        torch.cuda.is_available()


class _NoProcesses:
    """The fast tier's promise (``pytest -m "not integration"``): a test without the ``integration``
    marker starts no process and no etcd. While such a test runs in that tier, starting one fails
    the test with the line that says how to mark it."""

    def __init__(self, nodeid: str) -> None:
        self.nodeid = nodeid
        self.saved = [(subprocess.Popen, "_execute_child"), (os, "fork"), (os, "posix_spawn"), (os, "posix_spawnp")]
        self.saved = [(owner, name, getattr(owner, name)) for owner, name in self.saved if hasattr(owner, name)]

    def _refuse(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError(f"{self.nodeid} starts a process in the fast tier: mark it @pytest.mark.integration")

    def __enter__(self) -> None:
        for owner, name, _ in self.saved:
            setattr(owner, name, self._refuse)

    def __exit__(self, *exc: object) -> None:
        for owner, name, original in self.saved:
            setattr(owner, name, original)


def _in_fast_tier(item: pytest.Item) -> bool:
    marks = str(item.config.getoption("markexpr", "") or "")
    return "not integration" in marks and item.get_closest_marker("integration") is None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Optional[pytest.Item]) -> Iterator[None]:
    """``CUDA_VISIBLE_DEVICES=""`` around every test not marked ``gpu`` (setup, call and teardown);
    in the fast tier, no process started (:class:`_NoProcesses`)."""
    if _in_fast_tier(item):
        with _NoProcesses(item.nodeid):
            yield
        return
    if item.get_closest_marker("gpu") is not None:
        yield
        return
    before = os.environ.get(HIDE_GPUS)
    os.environ[HIDE_GPUS] = ""
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(HIDE_GPUS, None)
        else:
            os.environ[HIDE_GPUS] = before


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[EtcdServer]:
    server = EtcdServer().start()
    yield server
    server.stop()


@pytest.fixture
def private_etcd() -> Iterator[EtcdServer]:
    """An etcd of this test alone, for tests that stop it (SIGSTOP): stopping the shared one would
    disturb other tests."""
    server = EtcdServer().start()
    try:
        yield server
    finally:
        if server.proc is not None and server.proc.poll() is None:
            os.kill(server.proc.pid, signal.SIGCONT)
        server.stop()


@pytest.fixture
def etcd(etcd_server: EtcdServer) -> Iterator[EtcdStore]:
    store = connect(etcd_server.endpoint)
    yield store
    store.close()


@pytest.fixture
def job_id() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[Callable[..., Agent]]:
    """Factory: ``agents(args, name=..., env=..., program=...)`` starts an agent; all are killed at teardown."""
    started: List[Agent] = []

    def start(args: List[str], name: Optional[str] = None, env: Optional[dict] = None,
              program: Optional[List[str]] = None) -> Agent:
        agent = Agent(args, tmp_path, name or f"agent{len(started)}", env, program)
        started.append(agent)
        return agent

    yield start
    for a in started:
        a.close()


@pytest.fixture
def store() -> Iterator[FakeStore]:
    """An in-memory store for rendezvous unit tests (tests that need etcd use ``etcd``)."""
    s = FakeStore()
    yield s
    s.close()


@pytest.fixture
def cleanup() -> Iterator[List[Rendezvous]]:
    """Rendezvous objects a test appends here leave the job when it ends."""
    made: List[Rendezvous] = []
    yield made
    for r in made:
        r.leave()
