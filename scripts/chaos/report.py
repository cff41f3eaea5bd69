"""The chaos soak's verdict: the final checks, the job's goodput, the summary (a JSON-able dict) and its table."""

from __future__ import annotations

import json
import statistics
import time
from io import StringIO
from typing import Any, Callable, Dict, List, Tuple

from rich.console import Console

from elasticrun.checkpoint import list_checkpoints, verify
from elasticrun.cli.goodput_view import goodput_line
from elasticrun.cli.tables import Column, DataTable
from elasticrun.launch.events import EventKind

from .audit import AuditResult
from .kinds import KINDS, Fault, How


def _final_checks(root: str, audit: AuditResult) -> Dict[str, Any]:
    """Every complete checkpoint left verifies; resumes took the newest committed checkpoint."""
    left = {i.name: verify(root, i.name) for i in list_checkpoints(root) if i.status == "complete"}
    problems = [f"checkpoint {name} left at the end fails verification: {'; '.join(res.problems)}"
                for name, res in left.items() if not res.ok]
    newest = max(audit.saves, key=lambda s: (s[1], s[0]))[2] if audit.saves else None
    if newest and newest not in left:
        problems.append(f"the newest committed checkpoint {newest} is not among those left at the end")
    for t, gen, step, name in audit.resumes:
        before = [s for ts, s, _ in audit.saves if ts < t]
        if before and step < max(before):
            problems.append(f"generation {gen} resumed {name or 'nothing'} (step {step}) although step "
                            f"{max(before)} was committed before it started")
    return {"left": len(left), "left_verified": sum(res.ok for res in left.values()), "problems": problems}


def how_recovered(faults: List[Fault], events: List[str]) -> None:
    """Set each fault's ``how`` from the ``restart``/``rescale`` events (lines of the agents' ``--events-file``) of
    the rounds formed between its start and the next fault's; a round any agent says restarted is a restart."""
    rounds: Dict[int, Tuple[float, set]] = {}
    for line in events:
        try:
            ev = json.loads(line)
            if ev.get("event") in (EventKind.RESTART, EventKind.RESCALE):
                t, hows = rounds.setdefault(int(ev["round"]), (float(ev["time"]), set()))
                rounds[int(ev["round"])] = (min(t, float(ev["time"])), hows | {How(ev["recovery"])})
        except (ValueError, KeyError, TypeError):
            continue  # a line cut by a SIGKILL, or not an event of this form
    done = [f for f in faults if not f.skipped]
    for f, nxt in zip(done, [*(g.t_start for g in done[1:]), float("inf")]):
        hows = set().union(*(hows for t, hows in rounds.values() if f.t_start <= t < nxt))
        f.how = How.RESTART if How.RESTART in hows else How.IN_PLACE if hows else How.NONE


def _figures(fs: List[Fault]) -> Dict[str, Any]:
    """Faults, recoveries (in place, by restart), median and worst time to recover, worst time to full strength."""
    ttrs = [f.ttr for f in fs if f.ttr is not None]
    full = [f.full_at - f.t_ref for f in fs if f.full_at is not None]
    return {"faults": len(fs), "recovered": len(ttrs), "in_place": sum(f.how is How.IN_PLACE for f in fs),
            "restart": sum(f.how is How.RESTART for f in fs),
            "median_ttr_s": round(statistics.median(ttrs), 2) if ttrs else None,
            "worst_ttr_s": round(max(ttrs), 2) if ttrs else None,
            "worst_full_strength_s": round(max(full), 2) if full else None}


def summary(args: Any, soak: Any, audit: AuditResult, skipped: Dict[str, str]) -> Dict[str, Any]:
    """Everything the table shows, plus every fault and violation."""
    elapsed = time.time() - soak.t0
    doc, error = soak.machine.status_json() if not soak.machine.hosted else (
        None, "none: the job's own etcd, with its accounts, ended with the job")  # else the agents' accounts
    goodput = (doc or {}).get("goodput") or {"error": error or "the job's agents published no goodput account"}
    done = [f for f in soak.faults if not f.skipped]
    events = soak.machine.events_file
    how_recovered(done, events.read_text(errors="replace").splitlines() if events.exists() else [])
    every = _figures(done)
    try:
        final = _final_checks(str(soak.machine.ckpt_root), audit)
    except Exception as err:  # noqa: BLE001 - a broken root is a finding, not a crash of the soak
        final = {"left": 0, "left_verified": 0, "problems": [f"checking the checkpoint root failed: {err!r}"]}
    violations = list(soak.violations) + audit.problems + final["problems"]
    if not audit.saves:
        violations.append("no checkpoint was committed")
    return {
        "seed": args.seed, "minutes": args.minutes, "elapsed_s": round(elapsed, 1), "nodes": soak.nodes,
        "etcd_members": args.etcd_members,
        "faults_total": len(done), "faults_needing_recovery": every["in_place"] + every["restart"],
        "recoveries": every["recovered"], "recovered_in_place": every["in_place"], "recovered_by_restart":
        every["restart"], "median_ttr_s": every["median_ttr_s"], "worst_ttr_s": every["worst_ttr_s"],
        "by_kind": {name: _figures([f for f in done if f.kind.name == name]) for name in KINDS},
        "skipped_kinds": skipped,
        "steps": {"final": audit.final_step, "executed": audit.steps_executed, "lost_to_rollbacks": audit.steps_lost,
                  "generations": audit.generations},
        "checkpoints": {"committed": len(audit.saves), "verified": soak.checks["verified"],
                        "verify_failed": soak.checks["failed"], "retired_before_verify": soak.checks["retired"],
                        "save_failures": len(audit.save_failures),
                        "left_at_end": final["left"], "left_verified": final["left_verified"],
                        "restore_fallbacks": soak.count("restore_fallback")},
        "samples": {"checked": audit.samples_checked, "epochs": audit.epochs_checked, "seen_twice": audit.samples_twice,
                    "skipped": audit.samples_skipped, "unlogged": audit.samples_unlogged},
        "goodput": goodput,
        "faults": [f.to_json() for f in soak.faults],
        "violations": violations,
        "ok": not violations and not soak.aborted,
    }


def _s(v: Any) -> str:
    return "-" if v is None else f"{v:.1f}s" if isinstance(v, float) else str(v)


def render(res: Dict[str, Any], say: Callable[[str], None]) -> None:
    """The fault table (per kind and in all; skipped kinds say why), the run's figures, violations, the verdict."""
    table = DataTable([Column("fault", name=True), *(Column(header, justify="right") for header in (
        "count", "recovered", "in place", "restart", "median time to recover", "worst", "worst to full strength"))],
        title="chaos soak: faults")
    for kind, v in res["by_kind"].items():
        if v["faults"]:
            table.add_row(kind, str(v["faults"]), str(v["recovered"]), str(v["in_place"]), str(v["restart"]),
                          _s(v["median_ttr_s"]), _s(v["worst_ttr_s"]), _s(v["worst_full_strength_s"]))
    for kind, why in res["skipped_kinds"].items():
        table.add_row(kind, "skipped", "", "", "", "", "", why[:60])
    table.add_row("all", str(res["faults_total"]), str(res["recoveries"]), str(res["recovered_in_place"]),
                  str(res["recovered_by_restart"]), _s(res["median_ttr_s"]), _s(res["worst_ttr_s"]), "")
    buf = StringIO()
    Console(file=buf, force_terminal=False, color_system=None, soft_wrap=True).print(table)
    say(buf.getvalue().rstrip())
    say(f"run: seed {res['seed']}, {res['minutes']:g} min of faults, {res['elapsed_s']:.0f} s in all, "
        + (f"{res['etcd_members']} etcd member(s)" if res["etcd_members"] else "the job's own etcd"))
    for part in ("steps", "checkpoints", "samples"):  # samples unlogged: trained by a rank killed before its line
        say(f"{part}: " + ", ".join(f"{name.replace('_', ' ')} {n}" for name, n in res[part].items()))
    line = goodput_line(res["goodput"])
    say(line.plain if line is not None else f"goodput: {res['goodput'].get('error', 'none')}")
    say(f"violations: {len(res['violations'])}")
    for v in res["violations"]:
        say(f"VIOLATION: {v}")
    say("OK: every invariant held" if res["ok"] else "FAILED")
