"""The seeded chaos soak (python -m scripts.chaos): a 1-minute run in CI, and the audit that judges it.

The soak starts real agents, a real etcd, real gloo workers of examples/train.py; it needs root for the
tmpfs (disk_full) and the network namespace (partition) and skips those faults otherwise.
Deselect with ``-m 'not chaos'``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from scripts.chaos.__main__ import parse  # noqa: E402
from scripts.chaos.audit import analyse  # noqa: E402
from scripts.chaos.kinds import DRAWN, KINDS, schedule  # noqa: E402

pytestmark = pytest.mark.chaos


def _steps(gen: int, first: int, last: int, world: int, order: List[int], start_pos: int, t0: float,
           epoch: int = 0, resume: int = 0, begin: str = "resume") -> List[dict]:
    """Audit lines of one generation training on ``order`` (an epoch's permutation) from ``start_pos``; it begins
    with ``begin`` lines (``resume``: from a checkpoint, ``reform``: in place) at step ``resume``."""
    recs = [{"ev": begin, "t": t0, "round": gen, "restart": 0, "rank": r, "world": world, "step": resume,
             "name": None} for r in range(world)]
    pos = start_pos
    for i, step in enumerate(range(first, last + 1)):
        for r in range(world):
            idx = order[pos + r: pos + world * 2: world][:2]
            recs.append({"ev": "step", "t": t0 + 1 + i, "round": gen, "restart": 0, "rank": r, "world": world,
                         "step": step, "epoch": epoch, "idx": idx, "after": pos + 2 * world})
        pos += 2 * world
    return recs


def _order(n: int = 64) -> List[int]:
    import torch

    g = torch.Generator()
    g.manual_seed(0)
    return torch.randperm(n, generator=g).tolist()


def test_audit_follows_an_in_place_reform():
    # world 3 trains steps 1..5 (6 samples a step); at step 5 its ranks re-form in place to world 2 (a node
    # left) and train 6..9 from position 30; the lineage runs through both rounds without a checkpoint.
    order = _order(96)
    recs = _steps(0, 1, 5, 3, order, 0, 100.0) + _steps(1, 6, 9, 2, order, 30, 200.0, resume=5, begin="reform")
    res = analyse(recs, 96, 0)
    assert [(s.gen, s.first, s.last) for s in res.lineage] == [((0, 0), 1, 5), ((1, 0), 6, 9)]
    assert not res.problems and res.steps_lost == 0 and res.samples_checked == 5 * 6 + 4 * 4

    # the re-formed round dealt step 5's samples again: seen twice
    res = analyse(_steps(0, 1, 5, 3, order, 0, 100.0) + _steps(1, 6, 9, 2, order, 24, 200.0, resume=5,
                                                                  begin="reform"), 96, 0)
    assert res.samples_twice > 0 and any("seen twice" in p for p in res.problems)

    # a step of the re-formed round logged by one of its two ranks
    half = [r for r in recs if not (r["ev"] == "step" and r["round"] == 1 and r["step"] == 7 and r["rank"] == 1)]
    res = analyse(half, 96, 0)
    assert any("step 7 of generation (1, 0): logged by ranks [0]" in p for p in res.problems), res.problems

    # a kept worker still logging its old round's world among the new round's ranks
    mixed = [dict(r, world=3) if r["ev"] == "step" and r["round"] == 1 and r["rank"] == 1 else r for r in recs]
    res = analyse(mixed, 96, 0)
    assert any("logged by ranks [0, 1] of [2, 3]" in p for p in res.problems), res.problems

    # rank 1 killed after step 5's collectives, before its line; the survivors went on from step 5 in place:
    # its samples of step 5 were trained (unlogged), nothing is skipped
    killed = [r for r in recs if not (r["ev"] == "step" and r["round"] == 0 and r["step"] == 5 and r["rank"] == 1)]
    res = analyse(killed, 96, 0)
    assert not res.problems and res.samples_unlogged == 2 and res.samples_skipped == 0, res.problems
    # the same hole one step earlier, or before a restart from a checkpoint, is a skip
    early = [r for r in recs if not (r["ev"] == "step" and r["round"] == 0 and r["step"] == 4 and r["rank"] == 1)]
    assert any("step 4 of generation (0, 0): logged by ranks [0, 2]" in p for p in analyse(early, 96, 0).problems)
    resumed = [dict(r, ev="resume") if r["ev"] == "reform" else r for r in killed]
    res = analyse(resumed, 96, 0)
    assert res.samples_unlogged == 0 and any("logged by ranks [0, 2]" in p for p in res.problems), res.problems

    # survivors re-formed at different steps
    split = [dict(r, step=4) if r["ev"] == "reform" and r["rank"] == 1 else r for r in recs]
    assert any("began at different steps [4, 5]" in p for p in analyse(split, 96, 0).problems)


def test_the_worker_logs_the_round_it_is_in_when_it_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from scripts.chaos.worker import Audit

    for name, value in (("ELASTICRUN_ROUND", "4"), ("RANK", "2"), ("WORLD_SIZE", "3"),
                        ("TORCHELASTIC_RESTART_COUNT", "1")):
        monkeypatch.setenv(name, value)
    audit = Audit(str(tmp_path))
    audit.write("step", step=7)
    for name, value in (("ELASTICRUN_ROUND", "5"), ("RANK", "1"), ("WORLD_SIZE", "2")):  # re-formed in place
        monkeypatch.setenv(name, value)
    audit.write("step", step=8)
    lines = [json.loads(line) for line in next(tmp_path.glob("*.jsonl")).read_text().splitlines()]
    assert [(r["round"], r["restart"], r["rank"], r["world"], r["step"]) for r in lines] == [(4, 1, 2, 3, 7),
                                                                                           (5, 1, 1, 2, 8)]


def test_audit_finds_the_lineage_and_counts_rollbacks_and_duplicates():
    order = _order()
    # generation 0 (world 2) trains steps 1..5 (4 samples a step); a checkpoint at step 3; killed after 5.
    # generation 1 (world 4) resumes step 3 (position 12) and trains 4..6.
    recs = _steps(0, 1, 5, 2, order, 0, 100.0) + _steps(1, 4, 6, 4, order, 12, 200.0, resume=3)
    res = analyse(recs, 64, 0)
    assert [(s.gen, s.first, s.last) for s in res.lineage] == [((0, 0), 1, 3), ((1, 0), 4, 6)]
    assert res.steps_lost == 2 and res.final_step == 6
    assert res.samples_twice == 0 and res.samples_skipped == 0 and not res.problems

    # the same run, but generation 1 resumed from the wrong position: 4 samples trained twice.
    bad = _steps(0, 1, 5, 2, order, 0, 100.0) + _steps(1, 4, 6, 4, order, 8, 200.0, resume=3)
    res = analyse(bad, 64, 0)
    assert res.samples_twice > 0 or res.samples_skipped > 0
    assert any("epoch 0" in p for p in res.problems)

    # a rank's line missing for a step of the lineage is a skip, not silence
    holes = [r for r in recs if not (r["ev"] == "step" and r["step"] == 5 and r["rank"] == 3)]
    res = analyse(holes, 64, 0)
    assert res.samples_skipped > 0 and any("logged by ranks" in p for p in res.problems)


def test_each_fault_is_recovered_as_the_rounds_formed_until_the_next_one_say():
    from scripts.chaos.kinds import Fault, How
    from scripts.chaos.report import how_recovered

    faults = [Fault(KINDS[k], 0.0, 0.0, 1.0, t_start=t) for k, t in
              (("worker_kill", 10.0), ("bad_record", 20.0), ("graceful_leave", 30.0), ("hang", 50.0))]
    faults.insert(2, Fault(KINDS["partition"], 0.0, 0.0, 1.0, t_start=25.0, skipped="needs root"))

    def ev(event: str, round_: int, t: float, how: str, node: str = "a") -> str:
        return json.dumps({"event": event, "round": round_, "time": t, "recovery": how, "node": node})

    events = [ev("rescale", 1, 5.0, "in_place"),  # before the first fault: none of them
              ev("restart", 2, 11.0, "in_place"), ev("restart", 2, 11.1, "in_place", "b"),
              ev("rescale", 3, 31.0, "in_place"), '{"event": "rescale", "round": 4, "ti',  # cut by a SIGKILL
              ev("rescale", 4, 36.0, "in_place"), ev("round_formed", 5, 51.0, "restart"),
              ev("restart", 5, 51.0, "in_place"), ev("restart", 5, 51.2, "restart", "b")]  # one agent restarted
    how_recovered(faults, events)
    assert [(f.kind.name, f.how) for f in faults] == [
        ("worker_kill", How.IN_PLACE), ("bad_record", How.NONE), ("partition", How.NONE),
        ("graceful_leave", How.IN_PLACE), ("hang", How.RESTART)]


def test_schedule_is_seeded_and_covers_every_kind():
    a = [f.kind for _, f in zip(range(16), schedule(7, list(DRAWN), 2, 5.0))]
    b = [f.kind for _, f in zip(range(16), schedule(7, list(DRAWN), 2, 5.0))]
    assert a == b and set(a[: len(DRAWN)]) == set(DRAWN)
    outages = [f.duration for _, f in zip(range(64), schedule(7, [KINDS["etcd_outage"]], 2, 5.0))]
    assert 2.0 <= min(outages) and max(outages) <= 4.0, "a 2-minute run keeps etcd outages short"


def test_faults_given_are_injected_in_their_order():
    args = parse(["--minutes", "1", "--seed", "3", "--faults", "job_reuse,worker_kill,job_reuse,hang"])
    assert not args.shuffle and [k.name for k in args.kinds] == ["job_reuse", "worker_kill", "job_reuse", "hang"]
    drawn = [f.kind.name for _, f in zip(range(8), schedule(3, args.kinds, 1, 5.0, shuffle=args.shuffle))]
    assert drawn == ["job_reuse", "worker_kill", "job_reuse", "hang"] * 2
    assert parse(["--minutes", "1", "--seed", "3", "--faults", "hang,job_reuse", "--shuffle"]).shuffle
    every = parse(["--minutes", "1", "--seed", "3"])
    assert every.shuffle and {k.name for k in every.kinds} == set(KINDS) - {"node_leave", "member_loss",
                                                                          "leader_loss"}
    assert len(KINDS) == 17 and all(name == kind.name for name, kind in KINDS.items())


@pytest.mark.integration
def test_bad_arguments_give_one_line():
    proc = subprocess.run([sys.executable, "-m", "scripts.chaos", "--minutes", "1", "--seed", "1",
                           "--faults", "meteor"], capture_output=True, text=True, timeout=60, cwd=str(REPO))
    assert proc.returncode == 2 and "unknown fault kind(s) meteor" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "scripts.chaos", "--minutes", "1", "--seed", "1",
                           "--faults", "leader_loss"], capture_output=True, text=True, timeout=60, cwd=str(REPO))
    assert proc.returncode == 2 and "leader_loss need --etcd-members 3" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.integration
def test_a_hosted_etcd_run_draws_no_kind_that_needs_an_etcd_of_the_soaks_own():
    every = parse(["--minutes", "1", "--seed", "3", "--hosted-etcd"])
    names = {k.name for k in every.kinds}
    assert "agent_kill" in names and not names & {"etcd_restart", "etcd_outage", "member_loss", "leader_loss"}
    for argv, says in ((["--faults", "etcd_outage"], "etcd_outage need an etcd of the soak's own"),
                       (["--etcd-members", "3"], "--hosted-etcd and --etcd-members are exclusive")):
        proc = subprocess.run([sys.executable, "-m", "scripts.chaos", "--minutes", "1", "--seed", "1", "--hosted-etcd",
                               *argv], capture_output=True, text=True, timeout=60, cwd=str(REPO))
        assert proc.returncode == 2 and says in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


# A worker crash, a graceful leave and a lost node (each recovered in place) with a malformed record between the
# first two, stalled metrics clients, the two faults that only this soak injects (partition, disk_full: as root),
# a reused job id (the slowest: two agent start-ups), shm_full and hang (the restart path).
FAULTS = ["worker_kill", "bad_record", "graceful_leave", "agent_kill", "slow_metrics", "partition", "disk_full",
          "job_reuse", "shm_full", "hang", "etcd_outage"]
IN_PLACE = {"worker_kill", "graceful_leave", "agent_kill"}  # rank 0's node is never their target
NO_ROUND = {"bad_record", "slow_metrics", "disk_full", "etcd_outage"}  # the job trains on with its workers


def _rounds(workdir: Path) -> str:
    """The agents' lines that say how each round ended and started (what a failed assertion needs)."""
    marks = (" ended", "failed", "(Restart)", "restarts every worker", "not advanced", "etcd lease", "no progress for")
    lines = [line for log in sorted(workdir.glob("agent-*.log"))
             for line in log.read_text(errors="replace").splitlines() if any(m in line for m in marks)]
    return "\n".join(sorted(lines)[-80:])


def _gloo_stall(workdir: Path) -> bool:
    """Whether an agent gave up an in-place re-form after its deadline and the stacks it dumped show a worker
    waiting in a torch.distributed all-reduce: the known gloo stall after a killed node (a survivor's collective
    waits for the group's timeout on a connection gloo closed without failing it: docs/reliability.md)."""
    for log in workdir.glob("agent-*.log"):
        text = log.read_text(errors="replace")
        if "in-place re-form failed (workers did not re-form within" in text and re.search(
                r"torch/distributed/distributed_c10d\.py\", line \d+ in all_reduce", text):
            return True
    return False


def _recovered_how(summary: dict, workdir: Path) -> set:
    """(kind, how) of every fault injected; an ``agent_kill`` restarted by the known gloo stall (the only restart
    of an in-place kind, with its evidence in the agents' logs: docs/reliability.md) counts as in place."""
    how = {(f["kind"], f["recovered_how"]) for f in summary["faults"] if not f["skipped"]}
    restarted = {k for k, h in how if k in IN_PLACE and h != "in_place"}
    if restarted == {"agent_kill"} and _gloo_stall(workdir):
        how = {(k, "in_place" if k == "agent_kill" else h) for k, h in how}
    return how


@pytest.mark.integration
@pytest.mark.timeout(1200)
def test_one_minute_soak_with_the_faults_in_order(tmp_path: Path):
    out = tmp_path / "summary.json"
    proc = subprocess.run([sys.executable, "-m", "scripts.chaos", "--minutes", "1", "--seed", "1", "--faults",
                           ",".join(FAULTS), "--json", "--json-file", str(out), "--workdir", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=1100, cwd=str(REPO))
    report = proc.stdout[-3000:] + proc.stderr[-6000:]
    assert out.exists(), report
    s = json.loads(out.read_text())
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == s, "--json prints the same summary"
    assert s["violations"] == [], report
    assert proc.returncode == 0 and s["ok"], report
    assert s["faults_total"] >= 3, report
    assert s["recoveries"] == s["faults_total"], report
    assert s["faults_needing_recovery"] == s["recovered_in_place"] + s["recovered_by_restart"] < s["faults_total"]
    assert s["samples"]["seen_twice"] == 0 and s["samples"]["skipped"] == 0 and s["samples"]["checked"] > 0
    assert s["checkpoints"]["verified"] >= 1 and s["checkpoints"]["verify_failed"] == 0
    assert s["checkpoints"]["left_verified"] == s["checkpoints"]["left_at_end"] >= 1
    assert s["steps"]["final"] > 0
    assert 0 < s["goodput"]["goodput_ratio"] <= 1, s["goodput"]
    order = [f["kind"] for f in s["faults"]]
    here = [k for k in FAULTS if k not in s["skipped_kinds"]]  # without root: no partition, disk_full
    assert order == (here * 3)[: len(order)], f"the faults in the order given: {order}"
    drawn = {f["kind"] for f in s["faults"] if not f["skipped"]}
    assert set(here[:3]) <= drawn, f"at least the first 3 kinds that can run here: {sorted(drawn)}"
    assert all(s["by_kind"][k]["recovered"] == s["by_kind"][k]["faults"] > 0 for k in drawn), report
    how = _recovered_how(s, tmp_path / "run")
    assert IN_PLACE <= drawn and {h for k, h in how if k in IN_PLACE} == {"in_place"}, (how, _rounds(tmp_path / "run"))
    assert {h for k, h in how if k in NO_ROUND} <= {"none"}, how
    assert s["recovered_in_place"] >= len([f for f in s["faults"] if f["kind"] in IN_PLACE and not f["skipped"]])
