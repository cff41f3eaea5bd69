"""Facts about this machine that go into the node record: address and accelerators."""

from __future__ import annotations

import os
import socket
import sys
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


# Device nodes of a GPU that torch.cuda can use (NVIDIA, ROCm's kfd, WSL's dxg).
GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")


def gpu_device_present() -> bool:
    """Whether this Linux host has a GPU device node at all (cheap: no torch import); True elsewhere."""
    if not sys.platform.startswith("linux"):
        return True
    return any(os.path.exists(path) for path in GPU_DEVICE_NODES)


def gpu_available() -> bool:
    """Whether torch sees a GPU. A Linux host without GPU device nodes answers at once: importing
    torch takes seconds on a busy CPU host, on the critical path of a node joining a running job."""
    if not gpu_device_present():
        return False
    import torch

    return bool(torch.cuda.is_available() and torch.cuda.device_count() > 0)
