"""The chaos soak's machinery: a network namespace for one node, a small tmpfs checkpoint root, the
etcd member and the agent processes -- each undone by ``close()``, whatever state it was left in.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

import psutil

from elasticrun.store.server import free_port

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "worker.py"
WORKER_REL = WORKER.relative_to(REPO)  # scripts/chaos/worker.py, also under a frozen copy


def _run(cmd: List[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=20)


class NetNs:
    """A network namespace joined to the host by a veth pair (host side ``.1``, namespace side ``.2``)."""

    def __init__(self, tag: str, subnet: str = "192.168.239") -> None:
        self.ns = f"erchaos{tag}"
        self.host_if, self.ns_if = f"erch{tag}h", f"erch{tag}n"
        self.host_addr, self.ns_addr = f"{subnet}.1", f"{subnet}.2"
        self.subnet = subnet
        self.created = False

    def setup(self) -> Optional[str]:
        """Create it; None on success, else why not (the partition fault is then skipped)."""
        if not shutil.which("ip"):
            return "the `ip` command (iproute2) is not installed"
        if self.subnet + "." in _run(["ip", "-br", "addr"]).stdout:
            return f"{self.subnet}.0/30 is already in use on this host"
        steps = [
            ["ip", "netns", "add", self.ns],
            ["ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if],
            ["ip", "link", "set", self.ns_if, "netns", self.ns],
            ["ip", "addr", "add", f"{self.host_addr}/30", "dev", self.host_if],
            ["ip", "link", "set", self.host_if, "up"],
            ["ip", "netns", "exec", self.ns, "ip", "addr", "add", f"{self.ns_addr}/30", "dev", self.ns_if],
            ["ip", "netns", "exec", self.ns, "ip", "link", "set", self.ns_if, "up"],
            ["ip", "netns", "exec", self.ns, "ip", "link", "set", "lo", "up"],
        ]
        for cmd in steps:
            try:
                proc = _run(cmd)
            except (OSError, subprocess.TimeoutExpired) as err:
                self.close()
                return f"`{' '.join(cmd)}` failed: {err}"
            self.created = True
            if proc.returncode != 0:
                self.close()
                return f"`{' '.join(cmd)}` failed: {proc.stderr.strip()[:200]}"
        return None

    def partition(self, on: bool) -> None:
        """Cut (``on``) or restore the namespace's only link to the rest of the job."""
        _run(["ip", "netns", "exec", self.ns, "ip", "link", "set", self.ns_if, "down" if on else "up"])

    def close(self) -> None:
        if not self.created:
            return
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
        try:
            proc = _run(["mount", "-t", "tmpfs", "-o", f"size={self.size_mb}m,mode=0755", "tmpfs", str(self.path)])
        except (OSError, subprocess.TimeoutExpired) as err:
            return f"mount failed: {err}"
        if proc.returncode != 0:
            return f"mount -t tmpfs failed: {proc.stderr.strip()[:200]}"
        self.mounted = True
        return None

    def fill(self, leave_bytes: int = 0) -> int:
        """Write a ballast file until ``leave_bytes`` are left; returns the bytes written."""
        st = os.statvfs(self.path)
        want = max(0, st.f_bavail * st.f_frsize - leave_bytes)
        written = 0
        chunk = b"\0" * (1 << 20)
        with open(self.ballast, "wb") as f:
            while written < want:
                try:
                    written += f.write(chunk[: min(len(chunk), want - written)])
                    f.flush()
                except OSError:
                    break
        return written

    def drain(self) -> None:
        try:
            self.ballast.unlink()
        except FileNotFoundError:
            pass

    def close(self) -> None:
        self.drain()
        if self.mounted:
            for _ in range(20):
                if _run(["umount", str(self.path)]).returncode == 0:
                    break
                time.sleep(0.5)
            else:
                _run(["umount", "-l", str(self.path)])
            self.mounted = False


def freeze_code(dest: Path) -> Path:
    """Copy the package, the example and the worker wrapper to ``dest``: agents started later in the soak
    run the code of its start even while the working tree is being edited (``PYTHONPATH=dest``)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(REPO / "elasticrun", dest / "elasticrun", ignore=ignore)
    shutil.copytree(REPO / "examples", dest / "examples", ignore=ignore)
    (dest / WORKER_REL).parent.mkdir(parents=True)
    shutil.copy2(WORKER, dest / WORKER_REL)
    return dest


def tree(pid: int) -> List[psutil.Process]:
    """The process and all its descendants (those still alive)."""
    try:
        p = psutil.Process(pid)
        return [p, *p.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def kill_tree(pid: int) -> None:
    """SIGCONT then SIGKILL ``pid`` and every descendant (a stopped process must not block cleanup)."""
    procs = tree(pid)
    for p in procs:
        try:
            p.send_signal(signal.SIGCONT)
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


@dataclass
class AgentProc:
    """One agent process of a node slot (one incarnation)."""

    slot: int
    incarnation: int
    proc: subprocess.Popen
    started: float
    log_path: Path
    expected_exit: bool = False  # we killed or stopped it on purpose
    stopped: bool = False  # SIGSTOPped by us right now
    metrics_port: int = 0  # its --metrics-port (on 127.0.0.1 of its network namespace)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def workers(self) -> List[psutil.Process]:
        """Live worker processes (descendants running the chaos worker script)."""
        out = []
        for p in tree(self.pid)[1:]:
            try:
                if p.status() != psutil.STATUS_ZOMBIE and any(str(WORKER_REL) in a for a in p.cmdline()):
                    out.append(p)
            except psutil.NoSuchProcess:
                continue
        return out


@dataclass
class Launcher:
    """Starts agents for node slots; slot ``ns_slot`` (if any) runs inside ``netns``."""

    endpoint: str
    job: str
    host_addr: str
    run_dir: Path
    worker_args: List[str]
    env: dict
    netns: Optional[NetNs] = None
    ns_slot: Optional[int] = None
    heartbeat: float = 5.0
    hang_timeout: float = 0.0  # the agents' --hang-timeout (0: off)
    code_root: Path = REPO  # where the agents import elasticrun and the example from (see freeze_code)
    agents: List[AgentProc] = field(default_factory=list)

    def start(self, slot: int) -> AgentProc:
        incarnation = sum(1 for a in self.agents if a.slot == slot)
        log = self.run_dir / f"agent-slot{slot}-{incarnation}.log"
        in_ns = self.netns is not None and slot == self.ns_slot
        addr = self.netns.ns_addr if (in_ns and self.netns) else self.host_addr
        env = dict(self.env)
        if self.netns is not None:
            env["GLOO_SOCKET_IFNAME"] = self.netns.ns_if if in_ns else self.netns.host_if
        metrics_port = free_port()
        cmd = [sys.executable, "-m", "elasticrun", "run", "--nnodes", "2:4", "--nproc-per-node", "1",
               "--rdzv-endpoint", self.endpoint, "--rdzv-id", self.job, "--node-id", f"slot{slot}.{incarnation}",
               "--local-addr", addr, "--max-restarts", "100000", "--heartbeat-timeout", str(self.heartbeat),
               "--rescale-timeout", "600", "--join-timeout", "600", "--hang-timeout", f"{self.hang_timeout:g}",
               "--metrics-port", str(metrics_port), str(self.code_root / WORKER_REL), *self.worker_args]
        if in_ns and self.netns is not None:
            cmd = ["ip", "netns", "exec", self.netns.ns, *cmd]
        with open(log, "ab") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                    cwd=str(self.code_root), start_new_session=True)
        agent = AgentProc(slot, incarnation, proc, time.time(), log, metrics_port=metrics_port)
        self.agents.append(agent)
        return agent

    def live(self) -> List[AgentProc]:
        return [a for a in self.agents if a.proc.poll() is None]

    def slot_agent(self, slot: int) -> Optional[AgentProc]:
        for a in self.live():
            if a.slot == slot:
                return a
        return None

    def close(self) -> None:
        for a in self.agents:
            if a.proc.poll() is None or tree(a.pid):
                kill_tree(a.pid)
            try:
                a.proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
