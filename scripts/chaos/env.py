"""The chaos soak's machinery: a network namespace for one node, a small tmpfs checkpoint root, the agent
processes, and ``Machine``, what the faults act on -- each undone by ``close()``, whatever state it was left in.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Set, Tuple, Union

from elasticrun.errors import StoreError
from elasticrun.job import records
from elasticrun.job.keys import JobKeys
from elasticrun.rendezvous.etcdplan import endpoints_record, member_record, target_size
from elasticrun.rendezvous.records import node_record
from elasticrun.store.client import connect
from elasticrun.store.members import answers
from elasticrun.store.server import EtcdCluster, EtcdServer, free_port
from scripts.bench.common import kill_tree

HOSTED = 0  # Machine.etcd_members of a job that hosts its own etcd (--hosted-etcd)
REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "worker.py"
WORKER_REL = WORKER.relative_to(REPO)  # scripts/chaos/worker.py, also under a frozen copy


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
        """Create it; None on success, else why not."""
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
        """Write a ballast file until the filesystem is full; returns the bytes written."""
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
    """The running member the cluster says leads it, waiting up to ``timeout`` s for one; None if none does."""
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


def freeze_code(dest: Path) -> Path:
    """Copy the package, the example and the worker wrapper to ``dest``: agents started later in the soak
    run the code of its start even while the working tree is being edited (``PYTHONPATH=dest``)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(REPO / "elasticrun", dest / "elasticrun", ignore=ignore)
    shutil.copytree(REPO / "examples", dest / "examples", ignore=ignore)
    (dest / WORKER_REL).parent.mkdir(parents=True)
    shutil.copy2(WORKER, dest / WORKER_REL)
    return dest


def send(pid: int, sig: int) -> None:
    """``os.kill`` that ignores a process already gone."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
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
    """One agent process of a node slot (one incarnation)."""

    slot: int
    incarnation: int
    proc: subprocess.Popen
    started: float
    log_path: Path
    metrics_port: int  # its --metrics-port (on 127.0.0.1 of its network namespace)
    expected_exit: bool = False  # we killed or stopped it on purpose
    stopped: bool = False  # SIGSTOPped by us right now

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def label(self) -> str:
        return f"slot{self.slot}.{self.incarnation}"


@dataclass
class Launcher:
    """Starts agents for node slots on ``machine``, with the code frozen at the soak's start in the run folder;
    slot ``ns_slot`` (if any) runs inside the network namespace."""

    endpoint: str  # with a hosted etcd: the members the job published, as last read
    job: str
    machine: Machine
    heartbeat: float
    ns_slot: Optional[int] = None
    agents: List[AgentProc] = field(default_factory=list)

    def __post_init__(self) -> None:
        run_dir, machine = self.machine.run_dir, self.machine
        (run_dir / "tmp").mkdir(exist_ok=True)  # temp folders of killed agents stay in the run folder
        self.code_root = freeze_code(run_dir / "code")
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTICRUN_", "TORCHELASTIC_"))}
        self.env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CHAOS_AUDIT_DIR=str(machine.audit_dir),
                        CHAOS_STOP_FILE=str(machine.stop_file), CHAOS_HANG_FILE=str(machine.hang_file),
                        CHAOS_SHM_FULL_FILE=str(machine.shm_file), TMPDIR=str(run_dir / "tmp"),
                        CUDA_VISIBLE_DEVICES="",  # simulated nodes share this host: CPU and gloo
                        PYTHONPATH=os.pathsep.join(filter(None, [str(self.code_root), os.environ.get("PYTHONPATH")])))

    @property
    def hosted(self) -> bool:
        """The job hosts its etcd (c10d line): ``endpoint`` follows its members."""
        return self.machine.etcd_members == HOSTED

    @property
    def events_file(self) -> Path:
        """The agents' shared ``--events-file`` (docs/observability.md, "Event log")."""
        return self.machine.run_dir / "events.jsonl"

    def _rdzv_args(self) -> List[str]:
        """How an agent finds the job's etcd: the endpoint(s), or with a hosted etcd the c10d line -- the first
        agent hosts it, every later one joins at a member that answers (a node that took over the first host's
        address would otherwise start a second etcd)."""
        if not self.hosted:
            return ["--rdzv-endpoint", self.endpoint]
        if not self.agents:
            return ["--rdzv-backend", "c10d", "--rdzv-endpoint", self.endpoint, "--rdzv-conf", "is_host=1"]
        return ["--rdzv-backend", "c10d", "--rdzv-endpoint", self.client_endpoint(), "--rdzv-conf", "is_host=0"]

    def _hosted_members(self) -> Set[str]:
        """The nodes that run a member of the hosted job's etcd (its member records), read at the first member
        that answers; updates ``endpoint`` to the members the job published."""
        keys = JobKeys(self.job)
        for endpoint in self.endpoint.split(","):
            try:
                with connect(endpoint, retry_timeout=2, timeout=2) as store:
                    told = records.read(store.get(keys.etcd_endpoints), endpoints_record)
                    kvs, _ = store.get_prefix(keys.etcd_members)
            except StoreError:
                continue
            if told is not None:
                self.endpoint = ",".join(told.endpoints)
            return {rec.node_id for rec in (records.read(kv, member_record) for kv in kvs) if rec is not None}
        return set()

    def members_settled(self) -> bool:
        """The hosted job's etcd has the size its live nodes call for (its published endpoints): a node started
        now joins at a member that stays (one removed later would leave it waiting for a dead address)."""
        self._hosted_members()
        return len(self.endpoint.split(",")) == target_size(len(self.live()))

    def client_endpoint(self) -> str:
        """Where a client reaches the job's etcd: with a hosted etcd a member that answers now (the last known
        one when none does)."""
        if not self.hosted:
            return self.endpoint
        self._hosted_members()
        return next((e for e in self.endpoint.split(",") if answers(f"http://{e}", 1.0)), self.endpoint.split(",")[0])

    def member_agents(self) -> List[AgentProc]:
        """The live agents whose node runs a member of the hosted job's etcd, the first host first."""
        holders = self._hosted_members()
        return sorted((a for a in self.live() if a.label in holders), key=lambda a: a.started)

    def start(self, slot: int) -> AgentProc:
        """Start a new agent (the next incarnation) for node ``slot``."""
        incarnation = sum(1 for a in self.agents if a.slot == slot)
        machine, netns = self.machine, self.machine.netns
        log = machine.run_dir / f"agent-slot{slot}-{incarnation}.log"
        in_ns = netns is not None and slot == self.ns_slot
        env = dict(self.env)
        if netns is not None:
            env["GLOO_SOCKET_IFNAME"] = netns.ns_if if in_ns else netns.host_if
        port = free_port()
        cmd = [sys.executable, "-m", "elasticrun", "run", "--nnodes", "2:4", "--nproc-per-node", "1",
               *self._rdzv_args(), "--rdzv-id", self.job, "--node-id", f"slot{slot}.{incarnation}",
               "--local-addr", netns.ns_addr if (in_ns and netns) else machine.host_addr,
               "--max-restarts", "100000", "--heartbeat-timeout", str(self.heartbeat), "--rescale-timeout", "600",
               "--join-timeout", "600", "--hang-timeout", f"{machine.hang_timeout:g}", "--metrics-port", str(port),
               "--events-file", str(self.events_file),
               str(self.code_root / WORKER_REL), *machine.worker_args]
        if in_ns and netns is not None:
            cmd = ["ip", "netns", "exec", netns.ns, *cmd]
        with open(log, "ab") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                    cwd=str(self.code_root), start_new_session=True)
        self.agents.append(AgentProc(slot, incarnation, proc, time.time(), log, port))
        return self.agents[-1]

    def live(self) -> List[AgentProc]:
        return [a for a in self.agents if a.proc.poll() is None]

    def offer_inplace(self) -> bool:
        """Every live node's record says its workers opted in to in-place re-forming (a crash before that
        takes the restart path, as it should)."""
        keys = JobKeys(self.job)
        try:
            with connect(self.client_endpoint(), retry_timeout=2, timeout=2) as store:
                nodes = [records.read(store.get(keys.node(a.label)), node_record) for a in self.live()]
        except StoreError:
            return False
        return all(node is not None and node.inplace for node in nodes)

    def status_json(self) -> Tuple[Optional[Dict[str, Any]], str]:
        """``elasticrun status --json`` of the job as an operator reads it, run with the agents' code and
        environment: (its document, "") or (None, why there is none)."""
        cmd = [sys.executable, "-m", "elasticrun", "status", "--rdzv-endpoint", self.client_endpoint(),
               "--rdzv-id", self.job, "--json"]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=self.env,
                                  cwd=str(self.code_root))
        except (OSError, subprocess.TimeoutExpired) as err:
            return None, f"elasticrun status failed: {err}"
        if proc.returncode != 0 or "Traceback" in proc.stderr:
            return None, f"elasticrun status exited {proc.returncode}: {proc.stderr.strip()[-300:]}"
        try:
            return json.loads(proc.stdout), ""
        except ValueError:
            return None, f"elasticrun status printed no JSON: {proc.stdout.strip()[-300:]}"

    def close(self) -> None:
        """Kill every agent and everything below it, and reap them."""
        kill_tree([a.pid for a in self.agents])


@dataclass
class Machine:
    """What the soak set up on this host for the faults to act on; the fault kinds' ``prepare`` add to it. The
    workers poll ``hang_file`` (a PID: that worker hangs), ``shm_file`` (a node id: its memory tier is full)
    and ``stop_file`` (the step the job ends at)."""

    run_dir: Path
    root: bool  # running as root: tmpfs mounts and network namespaces are possible
    etcd_members: int
    hang_timeout: float
    worker_args: List[str]
    undo: Callable[[Callable[[], object]], object]  # adds a cleanup action (run in reverse order)
    netns: Optional[NetNs] = None
    tmpfs: Optional[Tmpfs] = None
    etcd: Optional[EtcdServer] = None  # the one member
    members: Optional[EtcdCluster] = None  # with --etcd-members 3

    def __post_init__(self) -> None:
        self.ckpt_root, self.audit_dir = self.run_dir / "ckpts", self.run_dir / "audit"
        self.hang_file, self.shm_file = self.run_dir / "hang-pid", self.run_dir / "shm-full-node"
        self.stop_file = self.run_dir / "stop-at-step"

    @property
    def host_addr(self) -> str:
        """The host's address for the job: the host side of the network namespace, if any, else loopback."""
        return self.netns.host_addr if self.netns else "127.0.0.1"

    def set_up(self, field_name: str, thing: Union[NetNs, Tmpfs], needs: str) -> Optional[str]:
        """``thing.setup()`` (as root only); once done, it is this machine's ``field_name`` and its ``close`` is
        on the undo list. Why it could not be set up, or None."""
        why = thing.setup() if self.root else f"needs root ({needs})"
        if not why:
            setattr(self, field_name, thing)
            self.undo(thing.close)
        return why
