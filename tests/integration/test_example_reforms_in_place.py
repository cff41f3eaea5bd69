"""The unmodified examples/train.py re-forms in place by default (real agents, etcd, gloo workers).

Two nodes train; C joins (2 → 3), then the node that is not rank 0 leaves gracefully (3 → 2).
Rank 0's worker process (it prints every step) lives through both changes: one ``start:`` line,
two ``re-formed in place`` lines, every step once and in order, the world size following the
membership. Then both remaining nodes are stopped, half a second apart: every rank stops at the same
step and saves.
A SIGKILLed worker of a three-node job is recovered in place: rank 0's process lives through it,
every step once, and the job finishes (an elastic job's survivors re-form without the crashed node
at once; a fixed-size job's wait for its replacement). A whole node SIGKILLed: the other two keep
their worker processes and go on at world 2.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path
from typing import List

import psutil
import pytest

from elasticrun.checkpoint import list_checkpoints
from elasticrun.job.keys import JobKeys

from helpers.procs import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train.py"
STEPS = 200  # a crashed worker's job: long enough that its replacement rejoins before the end, under load


def agent_args(endpoint: str, job: str, node: str, ckpts: Path) -> List[str]:
    """A 10 s SIGTERM grace: under a loaded host every rank must reach the stop's agreement and save before
    its agent kills it. ``--lr 0.01``: micro-batches of 4 at the example's default LR diverge."""
    return ["--nnodes", "2:3", "--max-restarts", "0", "--nproc-per-node", "1", "--rdzv-endpoint", endpoint,
            "--rdzv-id", job, "--node-id", node, "--heartbeat-timeout", "3", "--stability-window", "0.5",
            "--shutdown-timeout", "10", str(EXAMPLE), "--epochs", "1", "--dataset-size", "400000", "--batch-size", "4",
            "--lr", "0.01", "--step-sleep", "0.05", "--ckpt-every", "0", "--ckpt-dir", str(ckpts)]


def steps(out: str) -> List[tuple]:
    return [(int(m[1]), int(m[2])) for m in re.finditer(r"\bstep (\d+) loss \S+ world (\d+)$", out, re.M)]


def test_the_example_keeps_its_survivors_through_a_join_and_a_leave(etcd_server, job_id, agents, tmp_path):
    ckpts = tmp_path / "ckpts"
    a = {n: agents(agent_args(etcd_server.endpoint, job_id, n, ckpts), name=n) for n in "AB"}
    wait_until(lambda: any(len(steps(x.stdout())) >= 5 for x in a.values()), 150, "steps at world size 2")
    first = next(n for n, x in a.items() if steps(x.stdout()))  # rank 0's node: it prints the steps
    other = "B" if first == "A" else "A"
    out = a[first].stdout
    a["C"] = agents(agent_args(etcd_server.endpoint, job_id, "C", ckpts), name="C")
    wait_until(lambda: sum(w == 3 for _, w in steps(out())) >= 5, 150, "steps at world size 3")
    a[other].signal(signal.SIGTERM)
    wait_until(lambda: out().count("re-formed in place") >= 2, 150, "rank 0 re-formed for the leave")
    wait_until(lambda: steps(out())[-1][1] == 2 and sum(w == 2 for _, w in steps(out())) >= 10, 60, "world 2 again")
    assert a[other].wait(60) is not None
    # A whole-job stop whose signals reach the two nodes half a second apart (the example votes every step,
    # 20 times a second): still one stop at one step where every rank saves (InPlace's stop grace).
    a[first].signal(signal.SIGTERM)
    time.sleep(0.5)
    a["C"].signal(signal.SIGTERM)
    for n in (first, "C"):
        a[n].wait(60)
    text = out()
    assert text.count("start:") == 1, "rank 0's worker was never restarted"
    numbers = [s for s, _ in steps(text)]
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers))), "every step once, in order"
    worlds = [w for _, w in steps(text)]
    assert worlds[0] == 2 and 3 in worlds and worlds[-1] == 2, "2 → 3 → 2"
    assert re.search(r"checkpoint \S+ saved in \S+ \(stop\)", text), "every rank stopped together and saved"
    stopped_at = int(re.search(r"stopped: SIGTERM at step (\d+)", text)[1])
    latest = [c for c in list_checkpoints(str(ckpts)) if c.latest]
    assert [c.meta.step for c in latest] == [stopped_at], "the stop's checkpoint is committed, at the step it stopped"


def _store_host(p: psutil.Process) -> bool:
    """A round's c10d store host (forked from the fork server, as workers are): it listens, and each of its
    connections is to or from its own port (its own client too); a worker also connects to other ports
    (its round's store, its gloo peers)."""
    conns = p.net_connections("tcp")
    ours = {c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN}
    return bool(ours) and all(c.laddr.port in ours or (c.raddr and c.raddr.port in ours)
                              for c in conns if c.status == psutil.CONN_ESTABLISHED)


def _worker(agent) -> int:
    """The example's worker process under ``agent``: the deepest process naming the script, other than
    the fork server (the agent's child running ``elasticrun.launch.warm --server``, which names the
    script too, as do the workers forked from it) and, on a round's group rank 0 node, the store hosts
    forked from it (this round's and the previous one's)."""
    procs = [p for p in agent.descendants() if any(str(EXAMPLE) in part for part in p.cmdline())
             and not (p.ppid() == agent.pid and "--server" in p.cmdline()) and not _store_host(p)]
    pids = {p.pid for p in procs}
    leaves = [p.pid for p in procs if not any(c.pid in pids for c in p.children(recursive=True))]
    assert len(leaves) == 1, [p.cmdline() for p in procs]
    return leaves[0]


@pytest.mark.parametrize("nnodes", ["3", "2:3"])
def test_the_example_recovers_a_killed_worker_in_place(etcd_server, etcd, job_id, agents, tmp_path, nnodes):
    """``--nnodes 3``: the survivors wait for B's replacement and re-form with it (one re-form);
    ``--nnodes 2:3``: B sits the next round out, the survivors re-form at world 2 at once and again at
    world 3 when B's replacement joins (two re-forms, the crash still uses the one restart allowed)."""
    ckpts = tmp_path / "ckpts"

    def args(node: str, rank: int) -> List[str]:
        flags = agent_args(etcd_server.endpoint, job_id, node, ckpts)
        flags[flags.index("--nnodes") + 1] = nnodes
        flags[flags.index("--max-restarts") + 1] = "1"
        return ["--node-rank", str(rank), *flags, "--steps", str(STEPS)]

    a = {n: agents(args(n, i), name=n) for i, n in enumerate("ABC")}
    out = a["A"].stdout  # rank 0: it prints the steps
    # (with 2:3, round 0 may form at world 2 before C registers, on a loaded host: C then joins in place)
    wait_until(lambda: sum(w == 3 for _, w in steps(out())) >= 10, 150, "steps at world size 3")
    keys = JobKeys(job_id)  # a crash before the agents offer in-place re-forming takes the restart path
    wait_until(lambda: all((etcd.get_json(keys.node(n)) or {}).get("inplace") for n in "ABC"), 60, "opt-in")
    reforms_before = out().count("re-formed in place")
    os.kill(_worker(a["B"]), signal.SIGKILL)
    for n in "ABC":
        assert a[n].wait(150) == 0, a[n].output()
    text = out()
    assert text.count("start:") == 1, "rank 0's worker was never restarted"
    reforms = text.count("re-formed in place") - reforms_before
    assert reforms == (1 if nnodes == "3" else 2), text[-3000:]
    numbers = [s for s, _ in steps(text)]
    assert numbers == list(range(1, STEPS + 1)), "every step once, in order"
    worlds = [w for _, w in steps(text)]
    if nnodes == "3":
        assert set(worlds) == {3}
    else:
        full = worlds[worlds.index(3):]
        assert 2 in full and full[-1] == 3, "3 → 2 at once → 3 when B is back"
        assert "formed without this node" in a["B"].stderr(), a["B"].stderr()[-2000:]
    assert f"done: steps={STEPS}" in text
    assert "restarts 1/1" in a["A"].stderr(), "the crash used the one restart allowed"
    assert "re-forming in place" in a["C"].stderr(), "C kept its worker too"


def test_a_killed_rank_0_worker_of_an_elastic_job_is_recovered_in_place(etcd_server, etcd, job_id, agents, tmp_path):
    """Rank 0's worker crashes: its node sits the next round out, B becomes rank 0 (it hosts the round's
    store and sends the state) and C rank 1 without a restart of theirs; A's replacement rejoins last."""
    ckpts = tmp_path / "ckpts"

    def args(node: str) -> List[str]:
        flags = agent_args(etcd_server.endpoint, job_id, node, ckpts)
        flags[flags.index("--max-restarts") + 1] = "1"
        return [*flags, "--steps", "120"]

    a = {}
    for n in "ABC":  # registered in this order: A is group rank 0
        a[n] = agents(args(n), name=n)
        wait_until(lambda n=n: etcd.get_json(JobKeys(job_id).node(n)) is not None, 60, f"{n} registered")
    wait_until(lambda: len(steps(a["A"].stdout())) >= 10, 150, "steps at world size 3")
    keys = JobKeys(job_id)
    wait_until(lambda: all((etcd.get_json(keys.node(n)) or {}).get("inplace") for n in "ABC"), 60, "opt-in")
    survivors = {n: _worker(a[n]) for n in "BC"}
    os.kill(_worker(a["A"]), signal.SIGKILL)
    wait_until(lambda: all(a[n].stderr().count("workers re-formed in place") == 2 for n in "BC"), 150,
               "B and C re-formed twice: without A, then with its replacement")
    assert {n: _worker(a[n]) for n in "BC"} == survivors, "the survivors' worker processes are the same"
    for n in "ABC":
        assert a[n].wait(150) == 0, a[n].output()
    before, after = steps(a["A"].stdout()), steps(a["B"].stdout())
    numbers = [s for s, _ in before] + [s for s, _ in after]
    assert numbers == sorted(set(numbers)) and numbers[-1] == 120, "no step twice, in order: A's rank 0 then B's"
    # A may die after its step's last collective and before printing it: B (then rank 0) kept that step.
    assert before[-1][0] + 1 <= after[0][0] <= before[-1][0] + 2, (before[-3:], after[:3])
    assert numbers == list(range(1, 121)) or len(numbers) == 119, "no step lost but the one A did not print"
    worlds = [w for _, w in after]
    assert worlds[0] == 2 and worlds[-1] == 3, "B trained on at world 2 at once, then with A back"
    assert "formed without this node" in a["A"].stderr(), a["A"].stderr()[-2000:]
    assert "done: steps=120" in a["B"].stdout()


def test_the_example_goes_on_at_world_2_when_a_whole_node_is_killed(etcd_server, etcd, job_id, agents, tmp_path):
    """SIGKILL of node B's whole process tree (agent, fork server, worker): its lease expires, A and C keep
    their worker processes, re-form in place at world 2 and train on; no step runs twice; no restart used."""
    ckpts = tmp_path / "ckpts"
    a = {n: agents(["--node-rank", str(i), *agent_args(etcd_server.endpoint, job_id, n, ckpts)], name=n)
         for i, n in enumerate("ABC")}
    out = a["A"].stdout  # rank 0: it prints the steps
    # (round 0 may form at world 2 before C registers, on a loaded host: C then joins in place)
    wait_until(lambda: sum(w == 3 for _, w in steps(out())) >= 10, 150, "steps at world size 3")
    keys = JobKeys(job_id)
    wait_until(lambda: all((etcd.get_json(keys.node(n)) or {}).get("inplace") for n in "ABC"), 60, "opt-in")
    survivors = {n: _worker(a[n]) for n in "AC"}
    before = len(steps(out()))
    for proc in [*a["B"].descendants(), a["B"].proc]:
        try:
            os.kill(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    wait_until(lambda: sum(w == 2 for _, w in steps(out())[before:]) >= 10, 150, "steps at world size 2")
    assert {n: _worker(a[n]) for n in "AC"} == survivors, "the survivors' worker processes are the same"
    for n in "AC":
        a[n].signal(signal.SIGTERM)
    for n in "AC":
        assert a[n].wait(60) is not None, a[n].output()
    text = out()
    assert text.count("start:") == 1 and "re-formed in place" in text, text[-3000:]
    numbers = [s for s, _ in steps(text)]
    assert numbers == list(range(1, len(numbers) + 1)), "every step once, in order"
    worlds = [w for _, w in steps(text)]
    full = worlds[worlds.index(3):]
    assert full[-1] == 2 and full == sorted(full, reverse=True), "3, then 2 for good"
    assert etcd.get_json(keys.topology)["restart_count"] == 0, "a lost node re-formed in place uses no restart"
    assert re.search(r"checkpoint \S+ saved in \S+ \(stop\)", text), "the survivors stopped together and saved"
