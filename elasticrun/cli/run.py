"""``elasticrun [run] [options] script.py [args]``: launch a training script on this node.

Parsed by a small explicit parser with torchrun's grammar (:mod:`elasticrun.cli.torchrun_args`),
not by typer: options, then the script, then the script's arguments untouched; ``PET_*``
variables; both spellings of every torchrun flag.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from elasticrun.launch.config import LaunchConfig

HELP = """Launch SCRIPT on this node (the default command; a drop-in for torchrun).

Run the same command on every node; the agents meet in etcd, agree on ranks, start
workers with torchrun's environment, and re-form the job when nodes come and go.
Every torchrun flag is accepted with its spellings and PET_* variable (docs/cli.md).

  elasticrun --standalone --nproc-per-node 2 train.py --epochs 3

  elasticrun --nnodes 2:4 --nproc-per-node 8 --rdzv-endpoint etcd:2379 \\
      --rdzv-id job42 train.py

  # torchrun's static lines: node rank 0 hosts the job's etcd
  elasticrun --nnodes 2 --node-rank 0 --master-addr node0 --master-port 29500 \\
      train.py
"""


def config_from_argv(argv: Sequence[str]) -> Optional[LaunchConfig]:
    """The launch configuration of ``argv`` (None when help was asked for); ConfigError on bad input."""
    from elasticrun.cli.run_config import build_config
    from elasticrun.cli.torchrun_args import parse

    parsed = parse(argv)
    if parsed.help:
        return None
    return build_config(parsed)


def show_help(commands: Sequence[Tuple[str, str]] = ()) -> None:
    """Print the launcher's help (``elasticrun [run] --help``), then ``commands`` (name, summary) if any."""
    from elasticrun.cli.console import console
    from elasticrun.cli.run_help import render

    render(HELP, console, commands)


def main(argv: List[str]) -> int:
    """Run ``elasticrun run ARGV``; returns the exit code (errors raise ElasticrunError)."""
    cfg = config_from_argv(argv)
    if cfg is None:
        show_help()
        return 0
    from elasticrun.launch.agent import run_agent

    return run_agent(cfg)


def run() -> None:
    """Listed by ``elasticrun --help``; ``elasticrun run`` itself is parsed by :func:`main`."""
