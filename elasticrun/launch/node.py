"""Facts about this machine that go into the node record: address and accelerators (no torch)."""

from __future__ import annotations

import os
import socket
from typing import Any, Dict, List

from elasticrun.launch.gpus import visible_accelerators, visible_gpu_count


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


def uses_gpu(device_kind: str) -> bool:
    """Whether this node's workers train on CUDA GPUs: ``gpu``, or ``auto`` with a visible device
    (counted as torch would, without torch: :mod:`elasticrun.launch.gpus`)."""
    return device_kind == "gpu" or (device_kind == "auto" and visible_gpu_count() > 0)


def accelerators(use_gpu: bool) -> List[Dict[str, Any]]:
    """Model and memory per visible GPU (what the driver says), or the CPU count."""
    if use_gpu:
        out = visible_accelerators()
        if out:
            return out
    return [{"type": "cpu", "count": os.cpu_count() or 1}]
