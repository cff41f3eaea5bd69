"""A pre-warmed worker: import torch ahead of time, then become the training script.

The agent starts these while the rendezvous is still settling (e.g. during the heartbeat
timeout after a node died), and keeps a standby set during a round. Each one imports torch
(a standby one, started off the critical path, also the modules DDP pulls in on first use:
``--deep``), then blocks on stdin. When the round forms, the agent writes one JSON line —
``{"env": {...}, "argv": [...], "module": bool}`` — and the process sets its environment
and runs the script as ``__main__``, exactly like ``python script.py`` would. This takes
the ~2-4 s of imports out of every restart.

With ``--server`` the interpreter is a fork server instead (:mod:`elasticrun.launch.zygote`):
it starts bare (no preload: the first round's workers forked from it start like fresh
interpreters), imports torch and DDP's extras when the agent orders the preload, and stays; every
worker is a ``fork()`` of it that then runs the order as above. An order with ``store`` makes the
child the round's c10d store host instead (:mod:`elasticrun.launch.storeserver`).

Keep this module free of elasticrun imports: it must start fast and stay minimal.
"""

import atexit
import functools
import gc
import json
import os
import runpy
import sys


def _preload(deep: bool) -> None:
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401

    if deep:
        _preload_deep()


def _server_preload(deep: bool) -> None:
    """The fork server's preload (ordered by the agent, run on a thread of the server): torch, and with
    ``deep`` what DDP pulls in on first use."""
    _preload(deep)
    gc.freeze()  # the preloaded modules are permanent: collections (and the final one) skip them


def _preload_deep() -> None:
    import torch.nn.parallel  # noqa: F401

    try:  # the first DDP() imports torch._dynamo (~1.5 s CPU); a standby interpreter pays it early
        import torch._dynamo  # noqa: F401
    except Exception:  # noqa: BLE001 - an optional speed-up only
        pass


#: Process groups the script destroyed, referenced from here until exit (see _retain_destroyed_groups).
_DESTROYED_GROUPS: list = []
MAX_RETAINED_GROUPS = 16


def _retain_destroyed_groups() -> None:
    """Make ``torch.distributed.destroy_process_group`` keep each destroyed group's Python object
    until exit; it is unregistered and shut down at once, as before.

    pytorch/examples' pattern — ``destroy_process_group()``, then ``main()`` returns with DDP in
    its frame — lets DDP's Reducer drop a gloo group's last reference. Its destructor then runs
    with the GIL held and joins gloo's worker thread, which may itself wait for the GIL to free
    the tensors of the last collective: the finished worker never exits (seen under load: main
    thread in ``~ProcessGroupGloo`` → ``thread::join``, gloo's ``runLoop`` in
    ``gil_scoped_acquire``; a torch bug, as likely under torchrun). Released from Python (the
    atexit handler below, or when more than MAX_RETAINED_GROUPS pile up), a group's destructor
    runs with the GIL released.
    """
    try:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        original, world = c10d.destroy_process_group, c10d._world
    except (ImportError, AttributeError):
        return

    @functools.wraps(original)
    def destroy_process_group(group: object = None) -> None:
        try:
            doomed = list(world.pg_map) if group is None else [group]
        except Exception:  # noqa: BLE001 - torch internals moved: destroy as before
            doomed = []
        original(group)
        _DESTROYED_GROUPS.extend(g for g in doomed if g is not None)
        del _DESTROYED_GROUPS[:-MAX_RETAINED_GROUPS]

    c10d.destroy_process_group = destroy_process_group
    dist.destroy_process_group = destroy_process_group


def _bind_cpus(cpus: list) -> None:
    """Bind this process to ``cpus`` before the script runs (``--numa-binding``), as torch binds a
    worker it starts itself: the calling thread, then every other thread still on the old CPUs
    (one that set its own affinity keeps it). A refused binding fails the worker, as in torchrun."""
    wanted = {int(c) for c in cpus}
    original = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, wanted)
    except OSError as err:
        sys.stderr.write(f"elasticrun: cannot bind to CPUs {sorted(wanted)}: {err}\n")
        sys.stderr.flush()
        os._exit(1)
    for tid in os.listdir("/proc/self/task"):
        try:
            if os.sched_getaffinity(int(tid)) == original:
                os.sched_setaffinity(int(tid), wanted)
        except OSError:
            pass  # the thread ended meanwhile


class _DeepUse:
    """Marks (creates the empty file ``path``) that the script imports what a deep preload would have
    (``torch._dynamo``: DDP's first use), then steps aside. The agent preloads DDP's extras only for a
    script that uses them. A meta-path finder that finds nothing: every import goes on unchanged."""

    NAMES = frozenset({"torch._dynamo"})

    def __init__(self, path: str) -> None:
        self.path = path

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name in self.NAMES:
            try:
                sys.meta_path.remove(self)
            except ValueError:
                pass
            try:
                open(self.path, "a").close()
            except OSError:
                pass  # the agent then never learns it: a restart imports them as a fresh worker would
        return None


def _become(order: dict) -> None:
    if order.get("cpus"):
        _bind_cpus(order["cpus"])
    if order.get("deep_marker"):  # a fork of a server without DDP's extras
        sys.meta_path.insert(0, _DeepUse(str(order["deep_marker"])))
    if order.get("stacks_signal"):  # --hang-timeout: the agent asks for every thread's stack with it
        import faulthandler

        faulthandler.register(int(order["stacks_signal"]), all_threads=True)
    env = order["env"]
    os.environ.clear()
    os.environ.update(env)
    if "OMP_NUM_THREADS" in env and "torch" in sys.modules:  # a preloaded torch keeps its first pool size
        try:
            import torch

            torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
        except (ValueError, RuntimeError):
            pass
    if order.get("cwd"):
        os.chdir(order["cwd"])
    argv = list(order["argv"])
    sys.argv = argv
    try:
        if order.get("module"):
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            _run_script(argv[0])
    except SystemExit:
        raise
    except BaseException as err:  # noqa: BLE001 - reported like the interpreter would, then exit
        _report_uncaught(err)


def _run_script(path: str) -> None:
    """Run ``path`` as ``__main__`` the way ``python path`` does: ``__file__`` absolute, argv as given."""
    full = os.path.abspath(path)
    if not os.path.isfile(full):  # a directory or zip with __main__.py
        runpy.run_path(full, run_name="__main__")
        return
    import builtins
    import types
    from importlib.machinery import SourceFileLoader

    with open(full, "rb") as f:
        code = compile(f.read(), full, "exec", dont_inherit=True)
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=full, __cached__=None, __builtins__=builtins, __package__=None,
                         __loader__=SourceFileLoader("__main__", full))
    _LAUNCHER["main"] = sys.modules.get("__main__")  # keep this module alive while the script runs
    sys.modules["__main__"] = main
    exec(code, main.__dict__)


_LAUNCHER: dict = {}


def _launcher_frame(filename: str) -> bool:
    return filename == __file__ or filename == runpy.__file__ or filename.startswith("<frozen runpy")


def _report_uncaught(err: BaseException) -> None:
    """Print ``err`` through ``sys.excepthook`` without this launcher's frames, and exit like Python."""
    tb = err.__traceback__
    while tb is not None and _launcher_frame(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    if tb is not None:
        err.__traceback__ = tb  # the interpreter's hook prints the exception's own traceback
    sys.excepthook(type(err), err, err.__traceback__)
    if isinstance(err, KeyboardInterrupt):
        import signal

        sys.stdout.flush()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    sys.exit(1)


def _collect_while_alive() -> None:
    """Collect the script's cyclic garbage before interpreter shutdown (the last atexit handler).

    What the script's functions leave in reference cycles (DDP and its hooks, process groups,
    tensors) is otherwise freed only by the final collection inside ``Py_FinalizeEx``: gloo and
    autograd objects are then destroyed while the interpreter is finalizing, their native threads
    can no longer take the GIL, and the process hangs in that collection (seen: both workers of a
    finished job stuck in ``gc_collect_main`` with no Python frame, the agent waiting) or aborts.
    An interpreter that preloaded torch (and, deep, torch._dynamo) holds a huge long-lived heap,
    so its automatic full collections are rare and such cycles do survive until then. Collected
    here, the interpreter is still whole. Registered before the script runs, so it runs after the
    script's own atexit handlers. The groups the script destroyed go last (see
    :func:`_retain_destroyed_groups`).
    """
    gc.collect()
    _DESTROYED_GROUPS.clear()


def _read_order_file(order: dict) -> dict:
    """A big order (long argv or environment) comes through a private file: read and remove it."""
    if "order_file" not in order:
        return order
    path = order["order_file"]
    with open(path) as f:
        order = json.loads(f.read())
    os.unlink(path)
    return order


def main() -> None:
    # argv: [--deep] [--server] [--fresh] -- <script> <args>: the script only labels the process; orders
    # come on stdin. --fresh: no preload (a worker started at once, only for the order's bootstrap).
    flags = sys.argv[1 : sys.argv.index("--")] if "--" in sys.argv else []
    if "--server" in flags:
        from elasticrun.launch.zygote import serve

        order = serve(_server_preload)  # returns only in a forked child
    else:
        if "--fresh" not in flags:
            _preload(deep="--deep" in flags)
            gc.freeze()  # the preloaded modules are permanent: collections (and the final one) skip them
        line = sys.stdin.readline()
        if not line.strip():
            sys.exit(0)  # the agent went away or no longer needs us
        order = json.loads(line)
    order = dict(_read_order_file(order), fds=order.get("fds", []))
    if "store" in order:  # a fork server's child that hosts the round's c10d store, not a worker
        from elasticrun.launch.storeserver import serve_store

        fds = order["fds"]
        serve_store(fds[0], float(order["store"]["timeout_s"]), fds[1] if len(fds) > 1 else None)
    atexit.register(_collect_while_alive)
    if "torch.distributed" in sys.modules:  # preloaded; a worker that imports torch itself runs it as torchrun's
        _retain_destroyed_groups()
    _become(order)


if __name__ == "__main__":
    main()
