"""The job's goodput at the end of the soak, read as an operator would: ``elasticrun status --json``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Optional


def job_goodput(endpoint: str, job: str, env: Dict[str, str], code_root: Path) -> Dict[str, Any]:
    """``status --json``'s ``goodput`` of the job (the agents' accounts aggregated, docs/observability.md),
    or ``{"error": ...}`` saying why there is none."""
    cmd = [sys.executable, "-m", "elasticrun", "status", "--rdzv-endpoint", endpoint, "--rdzv-id", job, "--json"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env, cwd=str(code_root))
    except (OSError, subprocess.TimeoutExpired) as err:
        return {"error": f"elasticrun status failed: {err}"}
    if proc.returncode != 0:
        return {"error": f"elasticrun status exited {proc.returncode}: {proc.stderr.strip()[-300:]}"}
    try:
        doc = json.loads(proc.stdout)
    except ValueError:
        return {"error": f"elasticrun status printed no JSON: {proc.stdout.strip()[-300:]}"}
    g: Optional[Dict[str, Any]] = doc.get("goodput")
    return g if g else {"error": "the job's agents published no goodput account"}


def goodput_text(g: Dict[str, Any]) -> str:
    """One line for the soak's table: the ratio, node-seconds and the largest badput causes."""
    if g.get("goodput_ratio") is None:
        return str(g.get("error", "none"))
    top = ", ".join(f"{c['cause']} {100 * float(c['share']):.1f}%" if isinstance(c, dict) else str(c)
                    for c in g.get("top_badput") or [])
    return (f"{100 * float(g['goodput_ratio']):.1f}% of {float(g.get('wall_s', 0)):.0f} node-seconds "
            f"({g.get('nodes', '?')} node accounts); badput: {top or '-'}; {g.get('steps_lost', 0)} steps rolled back")
