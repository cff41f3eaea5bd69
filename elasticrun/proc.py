"""Child-process helpers shared by the etcd server and the worker group.

gRPC threads and ``fork`` do not mix, so children are started with
``subprocess.Popen(start_new_session=True)`` and no ``preexec_fn``. To make sure a
child never outlives us (even after SIGKILL of this process), the command is wrapped
in a tiny exec shim that sets a parent-death signal (Linux ``PR_SET_PDEATHSIG``) and
then ``exec``s the real program; a program that cannot be run (not found, not executable, not
a format the kernel runs) is one line on its stderr and exit 127 (not found) or 126, as in a shell.

Note: the parent-death signal fires when the *thread* that spawned the child exits,
so spawn long-lived children from a thread that lives as long as they should.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Iterable, List, Sequence

import psutil

_SHIM = (
    "import ctypes,os,signal,sys\n"
    "try:\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)\n"
    "except Exception:\n"
    "    pass\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(137)\n"
    "if sys.argv[2]:\n"
    "    try:\n"
    "        os.sched_setaffinity(0, [int(c) for c in sys.argv[2].split(',')])\n"
    "    except OSError as e:\n"
    "        sys.stderr.write(f'elasticrun: cannot bind to CPUs {sys.argv[2]}: {e}\\n')\n"
    "        os._exit(1)\n"
    "try:\n"
    "    os.execvp(sys.argv[3], sys.argv[3:])\n"
    "except OSError as e:\n"
    "    sys.stderr.write('elasticrun: cannot run %r: %s\\n' % (sys.argv[3], e.strerror or e))\n"
    "    os._exit(127 if isinstance(e, FileNotFoundError) else 126)\n"
)


def with_parent_death_signal(cmd: Sequence[str], cpus: Iterable[int] = ()) -> List[str]:
    """Wrap ``cmd`` so that it is SIGKILLed when this process dies (Linux only; no-op elsewhere).

    ``cpus``: the program runs bound to these CPUs (its affinity is set before the ``exec``, as
    ``numactl --physcpubind`` does); a binding the kernel refuses is one line on stderr and exit 1.
    """
    if not sys.platform.startswith("linux"):
        return list(cmd)
    bound = ",".join(str(c) for c in sorted(set(cpus)))
    return [sys.executable, "-S", "-I", "-c", _SHIM, str(os.getpid()), bound, *cmd]


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (signal 0). Another user's process counts as alive, and so
    does a pid that cannot be asked about: callers use this to leave things of live owners alone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except (OverflowError, ValueError, OSError):
        return True  # cannot tell: assume alive
    return True


def kill_process_group(pid: int, sig: int) -> None:
    """Send ``sig`` to the process group led by ``pid`` (children started with a new session)."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def terminate_tree(pids: Sequence[int], grace: float, sig: int = signal.SIGTERM) -> None:
    """Send ``sig`` to each process group, wait up to ``grace`` seconds, then SIGKILL what is left.

    Descendants that escaped the group (their own session) are found via psutil and killed too.
    """
    procs = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            procs.append(p)
            procs.extend(p.children(recursive=True))
        except psutil.NoSuchProcess:
            pass
    for pid in pids:
        kill_process_group(pid, sig)
    _, alive = psutil.wait_procs(procs, timeout=max(0.0, grace))
    if alive:
        for pid in pids:
            kill_process_group(pid, signal.SIGKILL)
        for p in alive:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=5)

