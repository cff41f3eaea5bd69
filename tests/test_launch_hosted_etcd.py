"""A job started with torchrun's c10d line hosts its own etcd, grows it to three members on three nodes, and
trains on when nodes holding members die — the node that hosted it first included — or leave.

Real agents, real etcd processes, real gloo workers (tests/scripts/train_loop.py) on loopback; each agent
runs with its own TMPDIR under the test's directory, so that what it leaves behind can be checked: no etcd
process and no member directory once the job is over.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Callable, List, Optional, Set

import psutil
import pytest

from elasticrun.errors import StoreError
from elasticrun.job.keys import JobKeys
from elasticrun.rendezvous.etcdplan import endpoints_record, member_record
from elasticrun.store import members as etcd
from elasticrun.store.client import connect
from elasticrun.store.server import find_etcd_binary, free_port

from helpers.elastic import end_job, steps
from helpers.launch import processes_with, run_cli, wait_agents
from helpers.procs import SCRIPTS, Agent, wait_until

pytestmark = pytest.mark.integration

HB = 5.0  # --heartbeat-timeout: a lost node's lease expires this long after its last keep-alive
# Training again after a node's loss: its lease expires (HB), the next round forms and the workers start.
# The machine the suite runs on is shared and loaded; the number measured is in docs/performance.md.
RESUME_SLACK_S = 25.0
HOSTING = "hosting the job's etcd"
STARTED = "started a member of the job's etcd"


class Job:
    """The agents of one c10d job on loopback, started like torchrun's multi-node line."""

    def __init__(self, agents: Callable[..., Agent], tmp_path: Path, nnodes: str, total: int) -> None:
        self.start_agent = agents
        self.port = free_port()
        self.out = tmp_path / "out"
        self.out.mkdir()
        self.tmp = tmp_path / "tmp"  # every agent's TMPDIR: its files, its etcd member's directory
        self.tmp.mkdir()
        self.nnodes, self.total = nnodes, total
        self.nodes: List[Agent] = []

    def start(self, name: str, *extra: str) -> Agent:
        agent = self.start_agent(
            [*extra, "--nnodes", self.nnodes, "--nproc-per-node", "1", "--rdzv-backend", "c10d",
             "--rdzv-endpoint", f"127.0.0.1:{self.port}", "--rdzv-id", "hosted", "--node-id", name,
             "--heartbeat-timeout", str(HB), "--stability-window", "1", "--shutdown-timeout", "3",
             "--max-restarts", "5", "--etcd-timeout", "30",
             str(SCRIPTS / "train_loop.py"), str(self.out), str(self.total), "0.1"],
            name=name, env={"TMPDIR": str(self.tmp)})
        self.nodes.append(agent)
        return agent

    def start_hosted(self, count: int) -> List[Agent]:
        """The first node hosts the etcd (it binds the endpoint first); then the others."""
        host = self.start("n0")
        wait_until(lambda: HOSTING in host.stderr(), 120, "n0 to host the job's etcd")
        return [host] + [self.start(f"n{i}") for i in range(1, count)]

    def training(self, world: int, after: float = 0.0) -> bool:
        return any(r["world"] == world and r["time"] > after for r in steps(self.out))

    def first_step(self, world: int, after: float) -> float:
        return min(r["time"] for r in steps(self.out) if r["world"] == world and r["time"] > after)

    def steps_left(self) -> int:
        done = steps(self.out)
        return self.total - (done[-1]["step"] + 1 if done else 0)

    def reachable(self) -> List[str]:
        """Endpoints of the job's etcd a live agent was told, then the one on the command line."""
        return [*(e for a in self.nodes if a.proc.poll() is None for e in endpoints(a)), f"127.0.0.1:{self.port}"]

    def members(self) -> Optional[List[etcd.Member]]:
        """etcd's member list, read from the first member that answers (None: none does)."""
        for endpoint in self.reachable():
            try:
                with connect(endpoint, retry_timeout=3, timeout=2) as store:
                    return etcd.list_members(store)
            except StoreError:
                continue
        return None

    def member_nodes(self) -> Set[str]:
        """The nodes whose members etcd lists as voting members now (read from the job's etcd itself)."""
        for endpoint in self.reachable():
            try:
                with connect(endpoint, retry_timeout=3, timeout=2) as store:
                    voters = {url for m in etcd.list_members(store) if m.voter for url in m.peer_urls}
                    kvs, _ = store.get_prefix(JobKeys("hosted").etcd_members)
            except StoreError:
                continue
            return {r.node_id for r in (member_record(kv.json()) for kv in kvs) if r.peer_url in voters}
        return set()

    def leftovers(self) -> List[str]:
        """etcd processes and member directories of this job's agents that are still there."""
        found = [f"process {p.pid}: {' '.join(p.cmdline())[:200]}" for p in processes_with(str(self.tmp))
                 if "etcd" in " ".join(p.cmdline())]
        found += [str(p) for p in self.tmp.glob("elasticrun-*/etcd-hosted-*")]  # launch/etcdhome.py
        return found


def endpoints(agent: Agent) -> List[str]:
    """The etcd endpoints the agent was told last (its 'the job's etcd is at ...' line)."""
    told = re.findall(r"the job's etcd is at (\S+) \(", agent.stderr())
    return told[-1].split(",") if told else []


def kill_tree(agent: Agent) -> float:
    """SIGKILL the agent and everything it started (its node dies); the time of the kill."""
    tree = [psutil.Process(agent.pid), *agent.descendants()]
    at = time.time()
    for p in tree:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    agent.proc.wait(10)
    return at


def test_three_nodes_train_on_when_the_node_hosting_the_etcd_dies(agents: Callable[..., Agent],
                                                                   tmp_path: Path) -> None:
    job = Job(agents, tmp_path, "2:3", total=350)
    host, *others = job.start_hosted(3)
    wait_until(lambda: all(len(endpoints(a)) == 3 for a in job.nodes), 180, "every agent to know 3 members")
    wait_until(lambda: job.training(3), 180, "the 3 nodes to train")
    assert job.member_nodes() == {"n0", "n1", "n2"}, "each node runs a member"
    assert job.steps_left() > 50, "the job must still train when its etcd's first host dies"

    killed_at = kill_tree(host)
    wait_until(lambda: job.training(2, after=killed_at), HB + RESUME_SLACK_S + 30, "the two others to train on")
    resumed = job.first_step(2, killed_at) - killed_at
    assert resumed <= HB + RESUME_SLACK_S, f"training again {resumed:.1f} s after the loss"
    wait_until(lambda: any("removed member elasticrun" in a.stderr() for a in others), 60,
               "the dead host's member to be removed")

    # `elasticrun status` answers at the surviving members' endpoints (the hosted one is gone); a member may be
    # electing a leader right after the removal, so the command is given the time a user would give it.
    original = f"127.0.0.1:{job.port}"
    survivors = sorted({e for a in others for e in endpoints(a) if e != original})
    assert survivors, "the survivors were told of members besides the dead host's"
    status = run_cli(["status", "--rdzv-endpoint", ",".join(survivors), "--rdzv-id", "hosted", "--json",
                      "--timeout", "30"], timeout=90)
    assert status.returncode == 0, status.stdout + status.stderr
    assert {m["node_id"] for m in json.loads(status.stdout)["members"]} == {"n1", "n2"}

    end_job(job.out)
    assert wait_agents(others, 300) == [0, 0], "\n".join(a.stderr()[-3000:] for a in others)
    assert (job.out / "finished").exists()
    assert job.leftovers() == []


def test_four_nodes_lose_two_member_nodes_one_after_the_other(agents: Callable[..., Agent], tmp_path: Path) -> None:
    job = Job(agents, tmp_path, "2:4", total=500)
    nodes = job.start_hosted(4)
    wait_until(lambda: all(len(endpoints(a)) == 3 for a in nodes), 240, "every agent to know 3 members")
    wait_until(lambda: job.training(4), 240, "the 4 nodes to train")
    holders = wait_until(lambda: job.member_nodes() if len(job.member_nodes()) == 3 else None, 120, "3 members")
    by_name = {a.name: a for a in nodes}
    first = by_name["n0"] if "n0" in holders else by_name[sorted(holders)[0]]  # the host, unless replaced
    [spare] = [a.name for a in nodes if a.name not in holders]

    first_loss = kill_tree(first)
    again = wait_until(lambda: (lambda now: now if len(now) == 3 and first.name not in now else None)(
        job.member_nodes()), 120, "a member to be added in the lost one's place")
    assert spare in again, again
    survivors = [a for a in nodes if a is not first]
    wait_until(lambda: all(sorted(endpoints(a)) == sorted(endpoints(survivors[0])) and len(endpoints(a)) == 3
                           for a in survivors), 120, "the survivors to know the 3 members")
    wait_until(lambda: job.training(3, after=first_loss), 120, "the 3 survivors to train")
    assert job.steps_left() > 50, "the job must still train at the second loss"

    second = by_name[sorted(again - {spare})[0]]
    second_loss = kill_tree(second)
    remaining = [a for a in survivors if a is not second]
    wait_until(lambda: job.training(2, after=second_loss), HB + RESUME_SLACK_S + 30, "the 2 survivors to train")
    end_job(job.out)
    assert wait_agents(remaining, 400) == [0, 0], "\n".join(a.stderr()[-3000:] for a in remaining)
    assert (job.out / "finished").exists()
    assert job.leftovers() == []


def test_a_two_node_job_survives_a_graceful_leave_of_the_node_hosting_its_etcd(agents: Callable[..., Agent],
                                                                             tmp_path: Path) -> None:
    """One member on one of two nodes: SIGTERM to its node hands the member over before it goes."""
    job = Job(agents, tmp_path, "1:2", total=300)
    host, other = job.start_hosted(2)
    wait_until(lambda: job.training(2), 180, "the 2 nodes to train")
    assert STARTED not in other.stderr() and len(endpoints(other)) <= 1, "two nodes keep one member"

    left_at = time.time()
    host.signal(signal.SIGTERM)
    assert host.wait(120) == 143, host.stderr()[-3000:]
    assert STARTED in other.stderr(), other.stderr()[-3000:]
    assert "removed member elasticrun" in other.stderr()
    wait_until(lambda: job.training(1, after=left_at), 120, "the remaining node to train alone")
    end_job(job.out)
    assert wait_agents([other], 300) == [0], other.stderr()[-3000:]
    assert job.leftovers() == []
    assert os.listdir(job.out)  # the job's output is there


def test_a_member_that_dies_while_joining_and_a_malformed_endpoints_record_leave_the_job_whole(
        agents: Callable[..., Agent], tmp_path: Path) -> None:
    """Node n2's etcd exits as it joins (after it was added as a learner): the learner is removed, n2 is asked no
    more, and the job's etcd is left with one voting member (when n1's joined first, the two shrink to one: two
    stop with either). Then garbage at ``etcd/endpoints`` is
    reported once by each agent that read it and replaced by the leader; the job trains to its end."""
    failing = tmp_path / "etcd-that-cannot-join"
    failing.write_text(f"#!/bin/sh\ncase \"$*\" in *existing*) echo 'cannot join (test)' >&2; exit 3;; esac\n"
                       f"exec {find_etcd_binary()} \"$@\"\n")
    failing.chmod(0o755)
    job = Job(agents, tmp_path, "3:3", total=300)
    host = job.start("n0")
    wait_until(lambda: HOSTING in host.stderr(), 120, "n0 to host the job's etcd")
    job.start("n1")
    n2 = job.start("n2", "--etcd-binary", str(failing))
    wait_until(lambda: "cannot start a member of the job's etcd" in n2.stderr(), 120, "n2's member to fail")
    assert "cannot join (test)" in n2.stderr() or "exited at start" in n2.stderr(), n2.stderr()[-3000:]

    def one_voter() -> Optional[List[etcd.Member]]:
        listed = job.members()
        return listed if listed is not None and len(listed) == 1 and listed[0].voter else None
    [left] = wait_until(one_voter, 120, "the job's etcd to shrink to one voting member, no learner left")
    # An agent never told other endpoints (n2 asked before n1: the first member stayed the only one) uses its
    # command line's.
    wait_until(lambda: all((endpoints(a) or [f"127.0.0.1:{job.port}"]) == [etcd.endpoint_of(left.client_urls[0])]
                           for a in job.nodes), 60, "every agent to use the one member left")
    wait_until(lambda: job.training(3), 120, "the 3 nodes to train")
    assert job.steps_left() > 50, "the job must still train when the endpoints record is spoiled"

    key = JobKeys("hosted").etcd_endpoints
    with connect(etcd.endpoint_of(left.client_urls[0]), retry_timeout=10) as store:
        store.put(key, "{not json")
        wait_until(lambda: (lambda kv: kv is not None and kv.value != b"{not json")(store.get(key)), 60,
                   "the leader to publish the endpoints again")
        assert endpoints_record(store.get(key).json()).endpoints == (etcd.endpoint_of(left.client_urls[0]),)
    end_job(job.out)
    assert wait_agents(job.nodes, 300) == [0, 0, 0], "\n".join(a.stderr()[-3000:] for a in job.nodes)
    said = [a.stderr().count(f"ignoring a malformed record in etcd at {key}")
            for a in job.nodes]
    assert max(said) == 1, said  # reported, once per agent that read it
    assert "Traceback" not in "".join(a.stderr() for a in job.nodes)
    assert (job.out / "finished").exists()
    assert job.leftovers() == []
