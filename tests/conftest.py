"""Shared fixtures: a real etcd server, a job id, agents as real processes.

Fixtures and hooks only: the helpers (condition waits with deadlines, the Agent process wrapper,
worker environments, CLI runners) are imported from the ``helpers`` package (tests/helpers/).
"""

from __future__ import annotations

import signal
import uuid
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


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[EtcdServer]:
    server = EtcdServer().start()
    yield server
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
    """Factory: ``agents(args, name=..., env=...)`` starts an agent; all are killed at teardown."""
    started: List[Agent] = []

    def start(args: List[str], name: Optional[str] = None, env: Optional[dict] = None) -> Agent:
        agent = Agent(args, tmp_path, name or f"agent{len(started)}", env)
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
