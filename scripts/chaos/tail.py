"""Incremental reading of the workers' audit logs (JSON lines, complete lines only)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict, List


class Tail:
    """Reads the workers' audit logs incrementally (complete lines only)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.offsets: Dict[str, int] = {}
        self.records: List[dict] = []

    def poll(self) -> List[dict]:
        new: List[dict] = []
        for name in sorted(os.listdir(self.directory)):
            if not name.endswith(".jsonl"):
                continue
            path = self.directory / name
            with open(path, "rb") as f:
                f.seek(self.offsets.get(name, 0))
                data = f.read()
            end = data.rfind(b"\n") + 1
            self.offsets[name] = self.offsets.get(name, 0) + end
            for line in data[:end].splitlines():
                try:
                    new.append(json.loads(line))
                except ValueError:
                    continue
        new.sort(key=lambda r: r["t"])
        self.records.extend(new)
        return new


__all__ = ["Tail"]
