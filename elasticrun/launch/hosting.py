"""The job's etcd for ``--standalone``, ``--rdzv-backend c10d`` and ``static``: host it or join it.

- ``--standalone``: a private etcd on a free loopback port.
- ``c10d`` with ``--rdzv-endpoint HOST:PORT``: the agent for which HOST is an address of its own
  machine (or ``--rdzv-conf is_host=1``) starts etcd on PORT; when several agents share that
  machine, the first to bind PORT hosts and the others join it (as torchrun's c10d store does).
- ``static`` (``--master-addr HOST --master-port PORT``): the agent with node rank 0 hosts.

Every other agent connects to HOST:PORT, retrying until it answers, within ``--join-timeout``.
etcd's peer port is a free port on the same address: a single-member etcd needs no peer
traffic, so nothing but that member uses it. The hosting agent keeps serving until every
other node has left (at most ``close_timeout`` s), like torchrun's exit barrier.

An etcd started here runs without fsync (``--unsafe-no-fsync``): it is a single member whose data
dir is a temp dir removed when the agent exits, and nothing ever restarts it on that data. fsync
only protects against losing the machine (a kernel crash or power loss, not a crash of etcd:
written pages survive the process), and losing this machine loses the job's store anyway — the
agent that serves it dies with it. So fsync buys no safety here and costs its start (the WAL and
the first raft entries are synced: slow on network or overlay disks) and every write of the
rendezvous. An etcd cluster the user runs (``--rdzv-endpoint`` of the etcd backend) is never
started here and keeps its own settings.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import time
from typing import Callable, List, Optional, Tuple

from elasticrun.errors import ElasticrunError, StoreError, StoreSetupError
from elasticrun.job.keys import JobKeys
from elasticrun.launch.config import LaunchConfig, RdzvBackend
from elasticrun.launch.etcdhome import member_server
from elasticrun.launch.hostlock import HostLock
from elasticrun.store.client import EtcdStore, parse_endpoints
from elasticrun.store.explain import START_HINT
from elasticrun.store.reach import wait_for_etcd
from elasticrun.store.server import EtcdServer, free_port

Say = Callable[[str], None]
HOSTED_NAME = "elasticrun"  # the etcd name of the member the hosting agent starts


def _ipv4s(host: str) -> List[str]:
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError, ValueError):
        return []
    return sorted({str(info[4][0]) for info in infos})


def _bindable(ip: str) -> bool:
    """True when ``ip`` is an address of this machine (binding to it works)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((ip, 0))
            return True
        except OSError:
            return False


def local_ip(host: str) -> Optional[str]:
    """The IPv4 address of ``host`` that belongs to this machine, or None (torchrun's is-host test)."""
    if host == "localhost":
        return "127.0.0.1"
    try:
        if ipaddress.ip_address(host).is_loopback:
            return host if _bindable(host) else None
    except ValueError:
        pass
    for ip in _ipv4s(host):
        if _bindable(ip):
            return ip
    if host in (socket.gethostname(), socket.getfqdn()):
        return "0.0.0.0"  # our own name that resolves to no address of ours: every interface
    return None


def _port_taken(ip: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((ip, port))
            return False
        except OSError as err:
            return err.errno == errno.EADDRINUSE


def _try_host(cfg: LaunchConfig, host: str, port: int, forced: bool, say: Say) -> Optional[EtcdServer]:
    """Start the job's etcd on ``host:port``; None when another agent already does (not ``forced``)."""
    ip = local_ip(host)
    if ip is None:
        if not forced:
            return None
        # Like torchrun's TCPStore: listen on every interface (HOST may be a NAT or service address).
        say(f"{host!r} is not an address of this machine: the job's etcd listens on port {port} of every interface")
        ip = "0.0.0.0"
    lock = HostLock(ip, port)
    if not lock.acquire() or _port_taken(ip, port):
        lock.release()
        if forced:
            raise StoreSetupError(f"cannot host the job's etcd at {host}:{port}: the port is in use on this "
                                  "machine; pick a free --master-port / endpoint port")
        return None  # another agent on this machine hosts it: join it
    try:
        server = member_server(cfg.rendezvous.rdzv_id, cfg.rendezvous.node_id, cfg.etcd.etcd_binary,
                               name=HOSTED_NAME, host=ip, client_port=port, peer_port=free_port(ip))
    except ElasticrunError:
        lock.release()
        raise
    try:
        server.start()
        if not server.running():
            raise StoreError(f"the job's etcd at {host}:{port} exited at start")
    except StoreError:
        server.stop()
        lock.release()
        if not forced and _port_taken(ip, port):
            return None  # taken meanwhile by something else: join whatever serves there
        raise
    server.after_stop.append(lock.release)  # held while the server runs; removed when it stops
    n = cfg.rendezvous.etcd_members
    future = f"it grows to {n} members on {n} nodes once they joined" if n > 1 else \
        "the job cannot continue if this node dies"
    say(f"hosting the job's etcd at {host}:{port} ({future})")
    return server


STANDALONE_HINT = "or run with --standalone for a single node"


def open_store(cfg: LaunchConfig, say: Say) -> Tuple[Optional[EtcdServer], EtcdStore]:
    """Start (standalone, or the hosting agent of c10d/static) and/or connect to the job's etcd.

    Before connecting, the endpoints are probed: a node whose etcd does not answer says so at
    once, then every few seconds, and gives up at its deadline (``--etcd-timeout``; a node that
    joins a hosted etcd: ``--join-timeout``)."""
    etcd: Optional[EtcdServer] = None
    retry = cfg.etcd.etcd_timeout
    if cfg.rendezvous.standalone and not cfg.rendezvous.rdzv_endpoint:
        etcd = member_server(cfg.rendezvous.rdzv_id, cfg.rendezvous.node_id, cfg.etcd.etcd_binary).start()
        cfg.rendezvous.rdzv_endpoint = etcd.endpoint
        say(f"started a private etcd at {etcd.endpoint}")
    elif cfg.rendezvous.rdzv_backend in (RdzvBackend.C10D, RdzvBackend.STATIC):
        host, port = parse_endpoints(cfg.rendezvous.rdzv_endpoint)[0]
        if cfg.rendezvous.rdzv_is_host is not False:
            etcd = _try_host(cfg, host, port, forced=cfg.rendezvous.rdzv_is_host is True, say=say)
        if etcd is None:
            who = "node rank 0" if cfg.rendezvous.rdzv_backend is RdzvBackend.STATIC else f"the agent on {host}"
            say(f"joining the job's etcd at {cfg.rendezvous.rdzv_endpoint} (hosted by {who})")
            join = max(1.0, cfg.rendezvous.join_timeout)
            try:  # the hosting node may start later: wait for its port, then connect at once
                retry = max(1.0, wait_for_etcd(cfg.rendezvous.rdzv_endpoint, join, say, "--join-timeout",
                                               what=f"the job's etcd at {cfg.rendezvous.rdzv_endpoint}"))
            except StoreError:
                raise StoreError(f"no etcd at {cfg.rendezvous.rdzv_endpoint} after {join:.0f}s (--join-timeout): start "
                                 f"{who.replace(host, 'that host')}, which hosts the job's etcd, with the same "
                                 "flags") from None
    else:
        try:
            retry = max(1.0, wait_for_etcd(cfg.rendezvous.rdzv_endpoint, cfg.etcd.etcd_timeout, say, "--etcd-timeout",
                                           hint=f"{START_HINT}, {STANDALONE_HINT}"))
        except StoreSetupError:
            raise
        except StoreError as err:
            raise StoreError(str(err)) from None
    try:
        store = cfg.etcd_settings().connect(JobKeys(cfg.rendezvous.rdzv_id).ping, retry_timeout=retry)
    except StoreError as err:
        if etcd is not None:
            etcd.stop()
        if str(err).startswith("cannot reach etcd") and STANDALONE_HINT not in str(err):
            raise type(err)(f"{err}, {STANDALONE_HINT}") from None
        raise
    store.retry_timeout = cfg.etcd.etcd_timeout
    return etcd, store


def wait_others_left(store: EtcdStore, nodes_prefix: str, timeout: float, say: Say) -> None:
    """Hosting agent, at the end: keep etcd up until no other node is registered (or ``timeout``)."""
    deadline = time.monotonic() + timeout
    told = False
    while time.monotonic() < deadline:
        try:
            kvs, _ = store.get_prefix(nodes_prefix)
        except StoreError:
            return
        if not kvs:
            return
        if not told:
            say(f"waiting up to {timeout:.0f}s for {len(kvs)} other node(s) to leave before stopping the job's etcd")
            told = True
        time.sleep(0.2)
