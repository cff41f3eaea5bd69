"""The goodput part of ``elasticrun status``: aggregate the agents' reports, render one line.

An agent publishes its account every few seconds (launch/observe.py, ``PUBLISH_S``) and at each
phase change; ``status`` read in between extends each live account to the time it reads it: the
seconds since the account was written are added to the phase the node was in (training: goodput;
otherwise badput of the cause the account names). At most :data:`MAX_EXTEND_S` are added (a node
whose clock is far off, or whose reports stopped, is not extrapolated for long); an account
written when the job ended is final and not extended.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from rich.text import Text

from elasticrun.launch.goodput import aggregate
from elasticrun.launch.observe import PUBLISH_S

MAX_EXTEND_S = 3 * PUBLISH_S


def extended(account: Dict[str, Any], now: float) -> Dict[str, Any]:
    """``account`` (one node's published summary) as it stands at ``now`` (Unix time)."""
    try:
        age = min(MAX_EXTEND_S, max(0.0, now - float(account["time"])))
    except (KeyError, TypeError, ValueError):
        return account
    if account.get("finished") or account.get("finished") is None or not age:
        return account  # final, or written by an agent that does not say (no extension)
    out = dict(account, wall_s=float(account.get("wall_s") or 0.0) + age)
    if account.get("phase") == "training":
        out["goodput_s"] = float(account.get("goodput_s") or 0.0) + age
    else:
        cause = str(account.get("cause") or "unknown")
        badput = dict(account.get("badput_s") or {})
        badput[cause] = float(badput.get(cause) or 0.0) + age
        out["badput_s"] = badput
    return out


def with_goodput(doc: Dict[str, Any]) -> Dict[str, Any]:
    """``doc`` with ``goodput``: the job's figures aggregated from its agents' reports, each extended
    to the document's ``time`` (None without any report)."""
    nodes = doc.get("goodput_nodes") or {}
    now = doc.get("time")
    accounts = [extended(a, float(now)) if isinstance(now, (int, float)) and isinstance(a, dict) else a
                for a in nodes.values()]
    doc["goodput"] = aggregate(accounts) if nodes else None
    return doc


def goodput_line(g: Optional[Dict[str, Any]]) -> Optional[Text]:
    """One line for ``status``: the job's goodput and its largest badput causes (None without figures)."""
    if not g or g.get("goodput_ratio") is None:
        return None
    causes = ", ".join(f"{t['cause']} {100 * t['share']:.1f}%" for t in g.get("top_badput") or [])
    ratio = float(g["goodput_ratio"])
    style = "green" if ratio >= 0.9 else "yellow" if ratio >= 0.5 else "red"
    return Text.assemble(("goodput ", "bold"), (f"{100 * ratio:.1f}%", style),
                         f" of {g['wall_s']:.0f} node-seconds ({g['nodes']} node(s))",
                         f" · badput: {causes}" if causes else "",
                         f" · {g['steps_lost']} step(s) rolled back" if g.get("steps_lost") else "")


__all__ = ["MAX_EXTEND_S", "extended", "goodput_line", "with_goodput"]
