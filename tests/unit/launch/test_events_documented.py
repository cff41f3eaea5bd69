"""Every event kind the agent writes to ``--events-file`` has its row in docs/observability.md."""

from __future__ import annotations

import re
from pathlib import Path

from elasticrun.launch.events import EventKind

DOC = Path(__file__).resolve().parents[3] / "docs" / "observability.md"


def test_every_event_kind_has_a_row_in_the_events_table() -> None:
    rows = set()
    for line in DOC.read_text().splitlines():
        match = re.match(r"\| (`[a-z_]+`(?:, `[a-z_]+`)*) \|", line)
        if match:
            rows.update(name.strip("`") for name in match.group(1).split(", "))
    missing = sorted(kind.value for kind in EventKind if kind.value not in rows)
    assert missing == [], f"event kinds without a row in {DOC.name}'s events table: {missing}"
