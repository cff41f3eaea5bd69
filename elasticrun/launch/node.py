"""Facts about this machine that go into the node record: address and accelerators."""

from __future__ import annotations

import os
import socket
from typing import Any, Dict, List


def local_address(etcd_host: str, etcd_port: int) -> str:
    """The local IP that routes to etcd (what other nodes can reach), loopback for loopback etcd."""
    try:
        infos = socket.getaddrinfo(etcd_host, etcd_port, socket.AF_INET, socket.SOCK_DGRAM)
        target = infos[0][4]
        if target[0].startswith("127."):
            return "127.0.0.1"
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(target)  # UDP connect sends nothing; it only picks the route
            return str(s.getsockname()[0])
    except OSError:
        return socket.getfqdn()


def accelerators(use_gpu: bool) -> List[Dict[str, Any]]:
    """GPU model and memory per visible device (torch.cuda), or the CPU count."""
    if use_gpu:
        import torch

        out = []
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            out.append({"type": "gpu", "index": i, "name": p.name, "memory_gib": round(p.total_memory / 2**30, 1)})
        if out:
            return out
    return [{"type": "cpu", "count": os.cpu_count() or 1}]


def gpu_available() -> bool:
    import torch

    return bool(torch.cuda.is_available() and torch.cuda.device_count() > 0)
