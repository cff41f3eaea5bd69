"""The chaos soak's machinery: a network namespace for one node and a tmpfs checkpoint root (each undone by its
``close()``, whatever state it was left in), and ``Machine``, what the faults act on, with the agent processes."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import psutil

from elasticrun.errors import StoreError
from elasticrun.job import records
from elasticrun.job.keys import JobKeys
from elasticrun.rendezvous.etcdplan import endpoints_record, member_record, target_size
from elasticrun.rendezvous.records import node_record
from elasticrun.store.client import connect
from elasticrun.store.members import answers
from elasticrun.store.server import EtcdCluster, EtcdServer, free_port
from scripts.bench.common import status_json

HOSTED = 0  # Machine.etcd_members of a job that hosts its own etcd (--hosted-etcd)
REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().relative_to(REPO).parent / "worker.py"  # scripts/chaos/worker.py


def _run(cmd: List[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=20)


def _first_failure(cmds: List[List[str]]) -> Optional[str]:
    """Run ``cmds`` in order; why the first one failed, or None."""
    for cmd in cmds:
        try:
            proc = _run(cmd)
        except (OSError, subprocess.TimeoutExpired) as err:
            return f"`{' '.join(cmd)}` failed: {err}"
        if proc.returncode != 0:
            return f"`{' '.join(cmd)}` failed: {proc.stderr.strip()[:200]}"
    return None


class NetNs:
    """A network namespace joined to the host by a veth pair (host side ``.1``, namespace side ``.2``)."""

    def __init__(self, tag: str, subnet: str = "192.168.239") -> None:
        self.ns, self.host_if, self.ns_if = f"erchaos{tag}", f"erch{tag}h", f"erch{tag}n"
        self.host_addr, self.ns_addr, self.subnet = f"{subnet}.1", f"{subnet}.2", subnet
        self.created = False

    def setup(self) -> Optional[str]:
        if not shutil.which("ip"):
            return "the `ip` command (iproute2) is not installed"
        if self.subnet + "." in _run(["ip", "-br", "addr"]).stdout:
            return f"{self.subnet}.0/30 is already in use on this host"
        self.created = True
        in_ns = ["ip", "netns", "exec", self.ns, "ip"]
        why = _first_failure([
            ["ip", "netns", "add", self.ns],
            ["ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if],
            ["ip", "link", "set", self.ns_if, "netns", self.ns],
            ["ip", "addr", "add", f"{self.host_addr}/30", "dev", self.host_if],
            ["ip", "link", "set", self.host_if, "up"],
            [*in_ns, "addr", "add", f"{self.ns_addr}/30", "dev", self.ns_if],
            [*in_ns, "link", "set", self.ns_if, "up"],
            [*in_ns, "link", "set", "lo", "up"],
        ])
        if why:
            self.close()
        return why

    def partition(self, on: bool) -> None:
        """Cut (``on``) or restore the namespace's only link to the rest of the job."""
        _run(["ip", "netns", "exec", self.ns, "ip", "link", "set", self.ns_if, "down" if on else "up"])

    def close(self) -> None:
        if self.created:
            _run(["ip", "link", "del", self.host_if])
            _run(["ip", "netns", "del", self.ns])
            self.created = False


class Tmpfs:
    """A size-limited tmpfs for the checkpoint root (``disk_full`` fills it with a ballast file)."""

    def __init__(self, path: Path, size_mb: int) -> None:
        self.path, self.size_mb, self.mounted = path, size_mb, False
        self.ballast = path / ".chaos-ballast"

    def setup(self) -> Optional[str]:
        self.path.mkdir(parents=True, exist_ok=True)
        why = _first_failure([["mount", "-t", "tmpfs", "-o", f"size={self.size_mb}m,mode=0755", "tmpfs",
                               str(self.path)]])
        self.mounted = why is None
        return why

    def fill(self) -> int:
        """Write a ballast file until the filesystem is full; the bytes written."""
        written, chunk = 0, b"\0" * (1 << 20)
        with open(self.ballast, "wb", buffering=0) as f, contextlib.suppress(OSError):
            while True:  # unbuffered: a short write, then ENOSPC
                written += f.write(chunk)
        return written

    def drain(self) -> None:
        self.ballast.unlink(missing_ok=True)

    def close(self) -> None:
        self.drain()
        if self.mounted and _run(["umount", str(self.path)]).returncode != 0:
            _run(["umount", "-l", str(self.path)])  # still busy: detach it now, freed once unused
        self.mounted = False


def etcd_leader(cluster: EtcdCluster, timeout: float = 20.0) -> Optional[EtcdServer]:
    """The running member the cluster says leads it, waiting up to ``timeout`` s for one."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with connect(cluster.endpoints, retry_timeout=2, timeout=2) as store:
                server = cluster.members.get(store.leader() or "")
        except StoreError:
            server = None
        if server is not None and server.running():  # a killed leader is named until the others notice
            return server
        time.sleep(0.2)
    return None


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path``'s content atomically (workers poll it)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def last_lines(path: Path, n: int) -> str:
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(line.strip()[:200] for line in lines[-n:])


@dataclass
class AgentProc:
    """One agent process of a node slot."""

    slot: int
    label: str  # slot<slot>.<incarnation>: its node id
    proc: subprocess.Popen
    started: float
    log_path: Path
    metrics_port: int  # its --metrics-port (on 127.0.0.1 of its network namespace)
    expected_exit: bool = False  # we killed or stopped it on purpose
    stopped: bool = False  # SIGSTOPped by us right now


@dataclass
class Machine:
    """This host as the soak set it up: what the kinds' ``prepare`` added, etcd, and the agents of the job's node
    slots, which run the code as it was at the start (copied to the run folder). The workers poll ``hang_file``
    (a PID: that worker hangs), ``shm_file`` (a node: its memory tier is full) and ``stop_file`` (the last step)."""

    run_dir: Path
    job: str
    etcd_members: int
    heartbeat: float
    hang_timeout: float
    worker_args: List[str]
    undo: Callable[[Callable[[], object]], object]  # adds a cleanup action (run in reverse order)
    endpoint: str = ""  # etcd's, once started; with a hosted etcd: the members the job published, as last read
    netns: Optional[NetNs] = None
    ns_slot: Optional[int] = None  # the node slot in the network namespace
    tmpfs: Optional[Tmpfs] = None
    etcd: Optional[EtcdServer] = None  # the one member
    members: Optional[EtcdCluster] = None  # with --etcd-members 3
    agents: List[AgentProc] = field(default_factory=list)

    def __post_init__(self) -> None:
        run = self.run_dir
        self.root = os.geteuid() == 0  # tmpfs mounts and network namespaces are possible
        self.hosted = self.etcd_members == HOSTED  # the job hosts its etcd (c10d line); ``endpoint`` follows it
        self.ckpt_root, self.audit_dir, self.code_root = run / "ckpts", run / "audit", run / "code"
        self.hang_file, self.shm_file, self.stop_file = run / "hang-pid", run / "shm-full-node", run / "stop-at-step"
        self.events_file = run / "events.jsonl"  # the agents' shared --events-file
        for folder in (run / "tmp", self.audit_dir, self.ckpt_root):  # tmp: temp folders of killed agents stay here
            folder.mkdir(exist_ok=True)
        for part in ("elasticrun", "examples"):
            shutil.copytree(REPO / part, self.code_root / part, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        (self.code_root / WORKER).parent.mkdir(parents=True)
        shutil.copy2(REPO / WORKER, self.code_root / WORKER)
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTICRUN_", "TORCHELASTIC_"))}
        self.env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CHAOS_AUDIT_DIR=str(self.audit_dir),
                        CHAOS_STOP_FILE=str(self.stop_file), CHAOS_HANG_FILE=str(self.hang_file),
                        CHAOS_SHM_FULL_FILE=str(self.shm_file), TMPDIR=str(run / "tmp"),
                        CUDA_VISIBLE_DEVICES="",  # simulated nodes share this host: CPU and gloo
                        PYTHONPATH=os.pathsep.join(filter(None, [str(self.code_root), os.environ.get("PYTHONPATH")])))

    @property
    def host_addr(self) -> str:
        """The host side of the network namespace, if any, else loopback."""
        return self.netns.host_addr if self.netns else "127.0.0.1"

    def set_up(self, field_name: str, thing: Union[NetNs, Tmpfs], needs: str) -> Optional[str]:
        """``thing.setup()`` (as root only), then this machine's ``field_name``, undone at the end; why not, or None."""
        why = thing.setup() if self.root else f"needs root ({needs})"
        if not why:
            setattr(self, field_name, thing)
            self.undo(thing.close)
        return why

    def start_etcd(self) -> None:
        """Start the one member (on the host side of the namespace, if any) or the 3-member cluster (the sweep at
        the end stops them); a hosted etcd: the endpoint its first agent hosts it at."""
        etcd_dir = self.run_dir / "etcd"
        if self.hosted:
            self.endpoint = f"127.0.0.1:{free_port()}"
        elif self.etcd_members == 3:
            etcd_dir.mkdir()
            self.members = EtcdCluster(3, base_dir=str(etcd_dir))
            for m in self.members.members.values():
                m.log_path = str(etcd_dir / f"{m.name}.log")
            self.endpoint = self.members.start(timeout=60).endpoints
        else:
            self.etcd = EtcdServer(host=self.host_addr, data_dir=str(etcd_dir), log_path=f"{etcd_dir}.log")
            self.endpoint = self.etcd.start(timeout=60).endpoint

    def member_agents(self) -> List[AgentProc]:
        """The live agents whose node runs a member of the hosted job's etcd (its member records, read at the first
        member that answers), the first host first; updates ``endpoint`` to the members the job published."""
        keys = JobKeys(self.job)
        for endpoint in self.endpoint.split(","):
            try:
                with connect(endpoint, retry_timeout=2, timeout=2) as store:
                    told = records.read(store.get(keys.etcd_endpoints), endpoints_record)
                    kvs, _ = store.get_prefix(keys.etcd_members)
            except StoreError:
                continue
            self.endpoint = ",".join(told.endpoints) if told is not None else self.endpoint
            holders = {rec.node_id for rec in (records.read(kv, member_record) for kv in kvs) if rec is not None}
            return sorted((a for a in self.live() if a.label in holders), key=lambda a: a.started)
        return []

    def members_settled(self) -> bool:
        """The hosted job's etcd has the members its live nodes call for: a node started now joins at one that stays."""
        self.member_agents()
        return len(self.endpoint.split(",")) == target_size(len(self.live()))

    def client_endpoint(self) -> str:
        """Where a client reaches the job's etcd: a hosted one at a member that answers now (else the last known)."""
        if not self.hosted or not self.agents:
            return self.endpoint
        self.member_agents()
        return next((e for e in self.endpoint.split(",") if answers(f"http://{e}", 1.0)), self.endpoint.split(",")[0])

    def start(self, slot: int) -> AgentProc:
        """Start a new agent (the next incarnation) for node ``slot``."""
        incarnation = sum(1 for a in self.agents if a.slot == slot)
        netns, label = self.netns, f"slot{slot}.{incarnation}"
        log = self.run_dir / f"agent-slot{slot}-{incarnation}.log"
        in_ns = netns is not None and slot == self.ns_slot
        env = dict(self.env)
        if netns is not None:
            env["GLOO_SOCKET_IFNAME"] = netns.ns_if if in_ns else netns.host_if
        port = free_port()
        # hosted: the c10d line, the first agent hosts the etcd, later ones join at a live member (never a 2nd etcd)
        rdzv = ["--rdzv-backend", "c10d", "--rdzv-conf", f"is_host={int(not self.agents)}"] if self.hosted else []
        cmd = [sys.executable, "-m", "elasticrun", "run", "--nnodes", "2:4", "--nproc-per-node", "1", *rdzv,
               "--rdzv-endpoint", self.client_endpoint(), "--rdzv-id", self.job, "--node-id", label,
               "--local-addr", netns.ns_addr if (in_ns and netns) else self.host_addr,
               "--max-restarts", "100000", "--heartbeat-timeout", str(self.heartbeat), "--rescale-timeout", "600",
               "--join-timeout", "600", "--hang-timeout", f"{self.hang_timeout:g}", "--metrics-port", str(port),
               "--events-file", str(self.events_file), str(self.code_root / WORKER), *self.worker_args]
        if in_ns and netns is not None:
            cmd = ["ip", "netns", "exec", netns.ns, *cmd]
        with open(log, "ab") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                    cwd=str(self.code_root), start_new_session=True)
        self.agents.append(AgentProc(slot, label, proc, time.time(), log, port))
        return self.agents[-1]

    def live(self) -> List[AgentProc]:
        return [a for a in self.agents if a.proc.poll() is None]

    def offer_inplace(self) -> bool:
        """Every live node's record says its workers opted in to in-place re-forming."""
        keys = JobKeys(self.job)
        try:
            with connect(self.client_endpoint(), retry_timeout=2, timeout=2) as store:
                nodes = [records.read(store.get(keys.node(a.label)), node_record) for a in self.live()]
        except StoreError:
            return False
        return all(node is not None and node.inplace for node in nodes)

    def status_json(self) -> Tuple[Optional[Dict[str, Any]], str]:
        """``elasticrun status --json`` of the job, run as an operator would: (its document, "") or (None, why)."""
        return status_json(self.client_endpoint(), self.job, self.env, self.code_root)
