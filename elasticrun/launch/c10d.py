"""The agent-hosted c10d TCPStore (``TORCHELASTIC_USE_AGENT_STORE=True``).

Every round gets a brand-new store on a port the OS picks, so no restarted worker can
read a previous attempt's keys (torch does not prefix per attempt when the agent hosts
the store) and there is no free-port race: the port is bound before it is published.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional


class RoundStore:
    """Owns at most one live TCPStore server at a time."""

    def __init__(self, timeout_s: float = 900.0) -> None:
        self._store: Optional[Any] = None
        self._timeout = timedelta(seconds=timeout_s)

    def fresh(self) -> int:
        """Close the previous store, start a new one, return its port."""
        from torch.distributed import TCPStore

        self.close()
        self._store = TCPStore(
            host_name="0.0.0.0",
            port=0,
            is_master=True,
            wait_for_workers=False,
            timeout=self._timeout,
            use_libuv=True,
        )
        return int(self._store.port)

    def close(self) -> None:
        # Dropping the last reference shuts the server down.
        self._store = None
