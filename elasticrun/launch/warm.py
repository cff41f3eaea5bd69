"""A pre-warmed worker: import torch ahead of time, then become the training script.

The agent starts these while the rendezvous is still settling (e.g. during the heartbeat
timeout after a node died), and keeps a standby set during a round. Each one imports torch
(a standby one, started off the critical path, also the modules DDP pulls in on first use:
``--deep``), then blocks on stdin. When the round forms, the agent writes one JSON line —
``{"env": {...}, "argv": [...], "module": bool}`` — and the process sets its environment
and runs the script as ``__main__``, exactly like ``python script.py`` would. This takes
the ~2-4 s of imports out of every restart.

Keep this module free of elasticrun imports: it must start fast and stay minimal.
"""

import json
import os
import runpy
import sys


def _preload(deep: bool) -> None:
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401

    if not deep:
        return
    import torch.nn.parallel  # noqa: F401

    try:  # the first DDP() imports torch._dynamo (~1.5 s CPU); a standby interpreter pays it early
        import torch._dynamo  # noqa: F401
    except Exception:  # noqa: BLE001 - an optional speed-up only
        pass


def _become(order: dict) -> None:
    env = order["env"]
    os.environ.clear()
    os.environ.update(env)
    if "OMP_NUM_THREADS" in env:
        try:
            import torch

            torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
        except (ValueError, RuntimeError):
            pass
    if order.get("cwd"):
        os.chdir(order["cwd"])
    argv = list(order["argv"])
    sys.argv = argv
    if order.get("module"):
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


def main() -> None:
    # argv: [--deep] -- <script> <args>: the script only labels the process; the order comes on stdin.
    _preload(deep="--deep" in sys.argv[1 : sys.argv.index("--")] if "--" in sys.argv else False)
    line = sys.stdin.readline()
    if not line.strip():
        sys.exit(0)  # the agent went away or no longer needs us
    _become(json.loads(line))


if __name__ == "__main__":
    main()
