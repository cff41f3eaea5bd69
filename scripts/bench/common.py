"""What the benches share: their JSON's ``summary`` rows, the command shown for a rerun, the job runner
:class:`Agents` (starts launchers, reads their output, kills what they started), ``elasticrun`` from this tree."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple, TypeVar

import psutil

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "examples" / "train.py"  # the example the benches run as a real training job
# torchrun "at its best": its c10d rendezvous with the shortest timeouts that still hold on a loaded machine
TORCHRUN_TUNED_CONF = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"
STEP = re.compile(r"STEP (\d+) WORLD (\d+) TIME (?P<t>\d+(?:\.\d+)?)")  # elastic_worker.py's rank-0 step lines
TAG_VAR = "BENCH_RUN_TAG"  # in every process a bench's job runner starts: what it kills at the end
T = TypeVar("T")
if str(REPO) not in sys.path:  # the benches import elasticrun as in this tree
    sys.path.insert(0, str(REPO))

from elasticrun.proc import terminate_tree  # noqa: E402 - from this tree (above)


def summary_row(metric: str, elasticrun: float, alternative: str, alt_value: Optional[float], unit: str = "s",
                better: str = "lower", device: str = "cpu", command: str = "", **extra: Any) -> Dict[str, Any]:
    """One row; its ratio is above 1 where elasticrun is ahead (None without both values); ``extra``: the bench's
    own fields."""
    ratio = None
    if elasticrun and alt_value:
        ratio = round(alt_value / elasticrun if better == "lower" else elasticrun / alt_value, 3)
    return {"metric": metric, "elasticrun": round(elasticrun, 4), "alternative": alternative,
            "alt_value": None if alt_value is None else round(alt_value, 4), "unit": unit, "better": better,
            "ratio": ratio, "device": device, "command": command, **extra}


def md_table(header: Sequence[str], rows: Iterable[Sequence[Any]], align: str = "") -> str:
    """A markdown table; ``align`` has one letter per column, ``r`` for right-aligned (the rest are left)."""
    rule = ["---:" if a == "r" else "---" for a in align.ljust(len(header), "l")]
    return "\n".join("| " + " | ".join(map(str, cells)) + " |" for cells in [header, rule, *rows])


def shown_command(script: str, argv: Optional[Sequence[str]] = None) -> str:
    """``python scripts/bench/SCRIPT ARGS`` as this bench was run (``argv``: its arguments, default sys.argv)."""
    args = sys.argv[1:] if argv is None else argv
    return shlex.join(["python", f"scripts/bench/{Path(script).name}", *args])


def kill_tree(pids: Iterable[int]) -> None:
    """SIGKILL each process of ``pids``, its process group and everything below it (workers may sit in their own
    sessions; a stopped process dies too), and reap them: the package's ``terminate_tree`` with no grace."""
    terminate_tree(list(pids), 0.0, signal.SIGKILL)


def send(pid: int, sig: int) -> None:
    """Signal ``sig`` to process ``pid``, if it still exists."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def interrupt_on(*signals: int) -> None:
    """Turn each of ``signals`` into KeyboardInterrupt, so that the cleanup of a Ctrl-C runs for them too."""
    for sig in signals:
        signal.signal(sig, signal.default_int_handler)


def fadvise_evict(path: str, evict: bool = True) -> None:
    """Drop the clean pages of file ``path`` or every file below it from the page cache (fsync first so every page
    is clean; only that when not ``evict``)."""
    files = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            if evict:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class Line(NamedTuple):
    """One line of an agent's output, when it was read (unix time) and what ``parse`` made of it (None: nothing)."""

    t: float
    agent: str
    text: str
    data: Any = None


class AgentsExited(RuntimeError):
    """Every agent still expected to run has exited."""


class Agents:
    """The launcher processes of one bench run, by name, each in its own session with this tree on ``PYTHONPATH``
    and this run's marker (``TAG_VAR``); a thread per agent keeps its :class:`Line` s (and ``log_dir/<name>.log``).
    :meth:`close` kills every agent and every process that carries the marker."""

    def __init__(self, env: Optional[Dict[str, str]] = None, log_dir: Optional[Path] = None,
                 parse: Callable[[str, float], Any] = lambda _text, _t: None) -> None:
        self.tag = uuid.uuid4().hex
        path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
        self.env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=path, **(env or {}),
                        **{TAG_VAR: self.tag})
        self.log_dir, self.parse = log_dir, parse
        self.procs: Dict[str, subprocess.Popen] = {}
        self.started: Dict[str, float] = {}  # unix time each agent was started
        self.gone: set = set()  # agents the bench stopped or killed on purpose
        self._lines: List[Line] = []
        self._lock = threading.Lock()
        self._readers: List[threading.Thread] = []

    def start(self, name: str, cmd: Sequence[str]) -> subprocess.Popen:
        self.started[name] = time.time()
        proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=self.env, cwd=str(REPO), start_new_session=True)
        self.procs[name] = proc
        reader = threading.Thread(target=self._read, args=(name, proc), daemon=True)
        reader.start()
        self._readers.append(reader)
        return proc

    def _read(self, name: str, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        with open(self.log_dir / f"{name}.log" if self.log_dir else os.devnull, "w") as log:
            for raw in proc.stdout:
                now = time.time()
                text = raw.decode(errors="replace").rstrip("\n")
                line = Line(now, name, text, self.parse(text, now))
                with self._lock:
                    self._lines.append(line)
                log.write(f"{now:.3f} {text}\n")
                log.flush()

    def lines(self, agent: Optional[str] = None) -> List[Line]:
        """The lines read so far (of ``agent`` alone, when given)."""
        with self._lock:
            return [ln for ln in self._lines if agent is None or ln.agent == agent]

    def found(self) -> List[Any]:
        """What ``parse`` made of the lines that it recognized, in order."""
        return [ln.data for ln in self.lines() if ln.data is not None]

    def running(self) -> bool:
        """Whether an agent the bench did not stop on purpose still runs."""
        return any(p.poll() is None for name, p in self.procs.items() if name not in self.gone)

    def wait_for(self, check: Callable[[], Optional[T]], timeout: float, what: str) -> T:
        """Poll ``check`` until it returns a value; TimeoutError after ``timeout`` s, :class:`AgentsExited` once
        no agent is left running."""
        deadline = time.monotonic() + timeout
        while True:
            result = check()
            if result is not None:
                return result
            if not self.running():
                codes = ", ".join(f"{n} exit {p.poll()}" for n, p in self.procs.items() if n not in self.gone)
                raise AgentsExited(f"the agents exited ({codes}) before {what}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout:.0f} s for {what}")
            time.sleep(0.05)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> float:
        """SIGKILL agent ``name`` and every process under it at once (a lost machine), or send the agent alone
        ``sig`` (SIGTERM: a graceful leave); the time of the signal."""
        self.gone.add(name)
        at = time.time()
        if sig != signal.SIGKILL:
            self.procs[name].send_signal(sig)
        else:
            kill_tree([self.procs[name].pid])
            self.procs[name].wait()
        return at

    def stop(self, timeout: float = 60.0) -> List[Optional[int]]:
        """SIGTERM every live agent (as a user's Ctrl-C would), wait up to ``timeout`` s in all, then SIGKILL
        what is left with everything below it and :meth:`close`; their exit codes."""
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline, codes = time.monotonic() + timeout, []
        for p in self.procs.values():
            try:
                codes.append(p.wait(max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                kill_tree([p.pid])
                codes.append(p.wait())
        self.close()
        return codes

    def close(self) -> None:
        """Kill every agent, everything under it and every process with this run's marker; reap them."""
        kill_tree(p.pid for p in self.procs.values())
        for p in self.procs.values():
            p.wait()
        marked = [p.pid for p in psutil.process_iter(["environ"])  # environ None: a process we may not read
                  if p.pid != os.getpid() and (p.info["environ"] or {}).get(TAG_VAR) == self.tag]
        kill_tree(marked)
        for reader in self._readers:
            reader.join(5)


def write_json(path: Any, doc: Any) -> None:
    """Write a bench's JSON document to ``path`` (indented, one trailing newline); no path: nothing."""
    if path:
        Path(path).write_text(json.dumps(doc, indent=1) + "\n")


def status_json(endpoint: str, job: str, env: Optional[Dict[str, str]] = None,
                cwd: Path = REPO) -> Tuple[Optional[Dict[str, Any]], str]:
    """``elasticrun status --json`` of job ``job``, run as an operator would: (its document, "") or (None, why)."""
    cmd = [sys.executable, "-m", "elasticrun", "status", "--rdzv-endpoint", endpoint, "--rdzv-id", job, "--json"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env, cwd=str(cwd))
        if proc.returncode != 0 or "Traceback" in proc.stderr:
            return None, f"elasticrun status exited {proc.returncode}: {proc.stderr.strip()[-300:]}"
        return json.loads(proc.stdout), ""
    except (OSError, subprocess.TimeoutExpired, ValueError) as err:
        return None, f"elasticrun status failed: {err}"
