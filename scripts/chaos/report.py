"""The chaos soak's verdict: the final checks, the job's goodput as ``elasticrun status --json`` reports it,
the summary (a JSON-able dict) and its table."""

from __future__ import annotations

import json
import statistics
from io import StringIO
from typing import Any, Callable, Dict, List, Tuple

from rich.console import Console

from elasticrun.checkpoint import list_checkpoints, verify
from elasticrun.cli.goodput_view import goodput_line
from elasticrun.cli.tables import Column, DataTable
from elasticrun.launch.events import EventKind

from .audit import AuditResult
from .env import Launcher
from .faults import Fault, How
from .kinds import KINDS


def job_goodput(launcher: Launcher) -> Dict[str, Any]:
    """``status --json``'s ``goodput`` of the job (the agents' accounts aggregated, docs/observability.md),
    or ``{"error": ...}`` saying why there is none."""
    if launcher.hosted:
        return {"error": "none: the job's own etcd, with its accounts, ended with the job"}
    doc, error = launcher.status_json()
    if doc is None:
        return {"error": error}
    return doc.get("goodput") or {"error": "the job's agents published no goodput account"}


def _final_checks(soak: Any, audit: AuditResult) -> Dict[str, Any]:
    """Every complete checkpoint left verifies; resumes took the newest committed checkpoint."""
    problems: List[str] = []
    root = str(soak.machine.ckpt_root)
    left = [i for i in list_checkpoints(root) if i.status == "complete"]
    ok = 0
    for info in left:
        res = verify(root, info.name)
        if res.ok:
            ok += 1
        else:
            problems.append(f"checkpoint {info.name} left at the end fails verification: {'; '.join(res.problems)}")
    newest = max(audit.saves, key=lambda s: (s[1], s[0]))[2] if audit.saves else None
    if newest and newest not in {i.name for i in left}:
        problems.append(f"the newest committed checkpoint {newest} is not among those left at the end")
    for t, gen, step, name in audit.resumes:
        before = [s for ts, s, _ in audit.saves if ts < t]
        if before and step < max(before):
            problems.append(f"generation {gen} resumed {name or 'nothing'} (step {step}) although step "
                            f"{max(before)} was committed before it started")
    return {"left": len(left), "left_verified": ok, "problems": problems}


def how_recovered(faults: List[Fault], events: List[str]) -> None:
    """Set each fault's ``how`` from the agents' events (``events``: the lines of their ``--events-file``): the
    ``restart``/``rescale`` events of the rounds formed between its start and the next fault's. Several agents
    write one event per round each; a round one of them says restarted is a restart."""
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


def _ttr_figures(ttrs: List[float]) -> Dict[str, Any]:
    """The median and worst of these times to recover (None without any)."""
    return {"median_ttr_s": round(statistics.median(ttrs), 2) if ttrs else None,
            "worst_ttr_s": round(max(ttrs), 2) if ttrs else None}


def _by_kind(done: List[Fault]) -> Dict[str, Dict[str, Any]]:
    """Per kind: faults, recoveries (in place, by restart), median and worst time to recover, worst time to full
    strength."""
    out = {}
    for name in KINDS:
        fs = [f for f in done if f.kind.name == name]
        ttrs = [f.ttr for f in fs if f.ttr is not None]
        full = [f.full_at - f.t_ref for f in fs if f.full_at is not None]
        out[name] = {"faults": len(fs), "recovered": len(ttrs),
                     "in_place": sum(f.how is How.IN_PLACE for f in fs),
                     "restart": sum(f.how is How.RESTART for f in fs), **_ttr_figures(ttrs),
                     "worst_full_strength_s": round(max(full), 2) if full else None}
    return out


def summary(args: Any, soak: Any, audit: AuditResult, skipped: Dict[str, str], elapsed: float,
            goodput: Dict[str, Any]) -> Dict[str, Any]:
    """Everything the table shows, plus every fault and violation; ``goodput`` is ``status --json``'s."""
    done = [f for f in soak.faults if not f.skipped]
    events = soak.launcher.events_file
    how_recovered(done, events.read_text(errors="replace").splitlines() if events.exists() else [])
    ttrs = [f.ttr for f in done if f.ttr is not None]
    in_place, restart = (sum(f.how is how for f in done) for how in (How.IN_PLACE, How.RESTART))
    try:
        final = _final_checks(soak, audit)
    except Exception as err:  # noqa: BLE001 - a broken root is a finding, not a crash of the soak
        final = {"left": 0, "left_verified": 0, "problems": [f"checking the checkpoint root failed: {err!r}"]}
    violations = list(soak.violations) + audit.problems + final["problems"]
    if not audit.saves:
        violations.append("no checkpoint was committed")
    return {
        "seed": args.seed, "minutes": args.minutes, "elapsed_s": round(elapsed, 1), "nodes": args.nodes,
        "etcd_members": args.etcd_members,
        "faults_total": len(done), "faults_needing_recovery": in_place + restart, "recoveries": len(ttrs),
        "recovered_in_place": in_place, "recovered_by_restart": restart,
        **_ttr_figures(ttrs), "by_kind": _by_kind(done), "skipped_kinds": skipped,
        "steps": {"final": audit.final_step, "executed": audit.steps_executed, "lost_to_rollbacks": audit.steps_lost,
                  "generations": audit.generations},
        "checkpoints": {"committed": len(audit.saves), "verified": soak.verified, "verify_failed": soak.verify_failed,
                        "retired_before_verify": soak.retired, "save_failures": len(audit.save_failures),
                        "left_at_end": final["left"], "left_verified": final["left_verified"],
                        "restore_fallbacks": soak.count("restore_fallback")},
        "samples": {"checked": audit.samples_checked, "epochs": audit.epochs_checked, "seen_twice": audit.samples_twice,
                    "skipped": audit.samples_skipped, "unlogged": audit.samples_unlogged},
        "goodput": goodput,
        "faults": [f.to_json() for f in soak.faults],
        "violations": violations,
        "ok": not violations and not soak.aborted,
    }


COLUMNS = [Column("fault", name=True), *(Column(header, justify="right") for header in (
    "count", "recovered", "in place", "restart", "median time to recover", "worst", "worst to full strength"))]


def _s(v: Any) -> str:
    return "-" if v is None else f"{v:.1f}s" if isinstance(v, float) else str(v)


def fault_table(res: Dict[str, Any]) -> DataTable:
    """Per kind and in all: faults, recoveries (in place, by restart), times to recover; skipped kinds say why."""
    table = DataTable(COLUMNS, title="chaos soak: faults")
    for kind, v in res["by_kind"].items():
        if v["faults"]:
            table.add_row(kind, str(v["faults"]), str(v["recovered"]), str(v["in_place"]), str(v["restart"]),
                          _s(v["median_ttr_s"]), _s(v["worst_ttr_s"]), _s(v["worst_full_strength_s"]))
    for kind, why in res["skipped_kinds"].items():
        table.add_row(kind, "skipped", "", "", "", "", "", why[:60])
    table.add_row("all", str(res["faults_total"]), str(res["recoveries"]), str(res["recovered_in_place"]),
                  str(res["recovered_by_restart"]), _s(res["median_ttr_s"]), _s(res["worst_ttr_s"]), "")
    return table


def render(res: Dict[str, Any], say: Callable[[str], None]) -> None:
    """Print the fault table and the run's figures, then every violation and the verdict (text from logs shown
    verbatim)."""
    buf = StringIO()
    Console(file=buf, force_terminal=False, color_system=None, soft_wrap=True).print(fault_table(res))
    say(buf.getvalue().rstrip())
    st, ck, sm, g = res["steps"], res["checkpoints"], res["samples"], res["goodput"]
    say(f"run: seed {res['seed']}, {res['minutes']:g} min of faults, {res['elapsed_s']:.0f} s in all, "
        + (f"{res['etcd_members']} etcd member(s)" if res["etcd_members"] else "the job's own etcd"))
    say(f"steps: {st['final']} trained, {st['executed']} executed, {st['lost_to_rollbacks']} lost to rollbacks, "
        f"{st['generations']} worker generations")
    say(f"checkpoints: {ck['committed']} committed, {ck['verified']} verified right after commit "
        f"({ck['retired_before_verify']} retired first), {ck['verify_failed']} failed; {ck['save_failures']} saves "
        f"refused; {ck['left_verified']}/{ck['left_at_end']} left at the end verify; {ck['restore_fallbacks']} "
        "restores fell back")
    say(f"samples: {sm['checked']} audited over {sm['epochs']} epochs: {sm['seen_twice']} seen twice, "
        f"{sm['skipped']} skipped, {sm['unlogged']} trained by a rank killed before it logged them")
    line = goodput_line(g)
    say(line.plain if line is not None else f"goodput: {g.get('error', 'none')}")
    say(f"violations: {len(res['violations'])}")
    for v in res["violations"]:
        say(f"VIOLATION: {v}")
    say("OK: every invariant held" if res["ok"] else "FAILED")
