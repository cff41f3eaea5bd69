"""The goodput part of ``elasticrun status``: aggregate the agents' reports, render one line."""

from __future__ import annotations

from typing import Any, Dict, Optional

from rich.text import Text

from elasticrun.launch.goodput import aggregate


def with_goodput(doc: Dict[str, Any]) -> Dict[str, Any]:
    """``doc`` with ``goodput``: the job's figures aggregated from its agents' reports (None without any)."""
    nodes = doc.get("goodput_nodes") or {}
    doc["goodput"] = aggregate(list(nodes.values())) if nodes else None
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


__all__ = ["goodput_line", "with_goodput"]
