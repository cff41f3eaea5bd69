"""The agent's own torch, imported in a background thread while etcd starts and the node registers.

The agent needs torch for two things: the c10d TCPStore it hosts for each round it may lead
(:mod:`elasticrun.launch.c10d`), and, with device ``auto``, whether this node has CUDA GPUs (and
which, for the node record). Importing torch costs 1-3 s of CPU (more with CUDA libraries on a
GPU host); done in the main thread it comes after etcd's start and the registration, in series.
Started first, it runs while the agent waits on etcd (the private etcd's start, a hosting node
that starts later, gRPC round trips: the main thread is then off the GIL), and the round starts
without waiting for it unless it is still running when the node publishes its accelerators.

Start it only after the agent has finished editing ``os.environ`` (secrets removed): C code
reading the environment during the import must not race with ``unsetenv`` in the main thread.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, List, Optional, Tuple

Accelerators = List[Dict[str, Any]]


class TorchPreload:
    """Imports ``torch.distributed`` and inspects the node's GPUs once, in a daemon thread."""

    def __init__(self, device_kind: str) -> None:
        from elasticrun.launch.node import gpu_device_present

        self.device_kind = device_kind  # "gpu", "cpu" or "auto"
        # Whether the answer needs torch: not on a CPU-only host (no GPU device node) with "auto".
        self.needs_torch = device_kind == "gpu" or (device_kind == "auto" and gpu_device_present())
        self._thread: Optional[threading.Thread] = None
        self._result: Optional[Tuple[bool, Accelerators]] = None
        self._error: Optional[BaseException] = None

    def start(self) -> TorchPreload:
        """Begin the import in the background (once); returns self."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="elasticrun-torch-preload", daemon=True)
            self._thread.start()
        return self

    def _work(self) -> None:
        try:
            import torch.distributed  # noqa: F401 - the round's TCPStore needs it: loaded now, off the main thread

            if self.needs_torch:
                from elasticrun.launch.node import accelerators, gpu_available

                use_gpu = self.device_kind == "gpu" or gpu_available()
                self._result = (use_gpu, accelerators(use_gpu))
        except BaseException as err:  # noqa: BLE001 - handed to the caller of result()
            self._error = err

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Wait up to ``timeout`` s for the import to end (started or not); True when it has ended."""
        if self._thread is None:
            return False
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def result(self) -> Tuple[bool, Accelerators]:
        """(use GPUs, the accelerators for the node record). Waits for the import only where the
        answer needs torch (a GPU host); re-raises the import's error then."""
        if not self.needs_torch:
            from elasticrun.launch.node import accelerators

            return False, accelerators(False)
        self.start()
        assert self._thread is not None
        while self._thread.is_alive():
            self._thread.join(0.2)  # short joins: a signal handler in the main thread still runs promptly
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result


__all__ = ["TorchPreload"]
