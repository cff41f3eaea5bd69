"""``elasticrun [run] [options] script.py [args]``: launch a training script on this node."""

from __future__ import annotations

import uuid
from typing import List, Optional

import typer

from elasticrun.cli.etcd_options import ETCD_CACERT, ETCD_CERT, ETCD_KEY, ETCD_PASSWORD, ETCD_USER, PANEL
from elasticrun.config import LaunchConfig, default_node_id, parse_nnodes, parse_nproc
from elasticrun.models import AdaptationStrategy, RedistributionType

HELP = """Launch SCRIPT on this node (the default command; torchrun-compatible).

Run the same command on every node; the agents meet in etcd, agree on ranks, start
workers with torchrun's environment, and re-form the job when nodes come and go.

  elasticrun --standalone --nproc-per-node 2 train.py --epochs 3

  elasticrun --nnodes 2:4 --nproc-per-node 8 --rdzv-endpoint etcd:2379 --rdzv-id job42 train.py
"""

_RDZV = "Rendezvous"
_WORKERS = "Workers"
_ELASTIC = "Elasticity"
_LOGS = "Logs"
_ETCD = PANEL


def run(
    script: str = typer.Argument(
        ..., metavar="SCRIPT", help="Training script (or module with -m, command with --no-python)."
    ),
    script_args: Optional[List[str]] = typer.Argument(
        None, metavar="[ARGS]...", help="Passed to the script unchanged."
    ),
    nnodes: str = typer.Option("1", "--nnodes", help="Number of nodes: N or MIN:MAX.", rich_help_panel=_RDZV),
    nproc_per_node: str = typer.Option(
        "1", "--nproc-per-node", "--nproc_per_node", help="Workers per node: N, gpu, cpu or auto.",
        rich_help_panel=_WORKERS,
    ),
    rdzv_endpoint: str = typer.Option(
        "", "--rdzv-endpoint", "--rdzv_endpoint", envvar="ELASTICRUN_RDZV_ENDPOINT",
        help="etcd endpoints host:port[,host:port...].", rich_help_panel=_RDZV,
    ),
    rdzv_id: Optional[str] = typer.Option(
        None, "--rdzv-id", "--rdzv_id", "--run-id", help="Job id shared by all nodes \\[default: 'default'].",
        rich_help_panel=_RDZV,
    ),
    standalone: bool = typer.Option(
        False, "--standalone", help="Single node: start a private etcd for this run (implied by --nnodes 1 "
        "without --rdzv-endpoint).", rich_help_panel=_RDZV
    ),
    node_id: Optional[str] = typer.Option(
        None, "--node-id", help="Stable id of this node \\[default: random@host:pid].", rich_help_panel=_RDZV
    ),
    local_addr: Optional[str] = typer.Option(
        None, "--local-addr", "--local_addr", help="Address other nodes reach this one at \\[default: route to etcd].",
        rich_help_panel=_RDZV,
    ),
    module: bool = typer.Option(
        False, "-m", "--module", help="Run SCRIPT as a Python module.", rich_help_panel=_WORKERS
    ),
    no_python: bool = typer.Option(
        False, "--no-python", "--no_python", help="Run SCRIPT as a command, not with python.", rich_help_panel=_WORKERS
    ),
    heterogeneous: bool = typer.Option(
        False, "--heterogeneous", help="Allow nodes with different --nproc-per-node.", rich_help_panel=_WORKERS
    ),
    backend: Optional[str] = typer.Option(
        None, "--backend", help="Backend hint for workers (ELASTICRUN_BACKEND) \\[default: nccl on GPU, else gloo].",
        rich_help_panel=_WORKERS,
    ),
    max_restarts: int = typer.Option(
        3, "--max-restarts", "--max_restarts", help="Worker-failure restarts for the whole job.",
        rich_help_panel=_ELASTIC,
    ),
    heartbeat_timeout: float = typer.Option(
        5.0, "--heartbeat-timeout", help="Seconds without heartbeat before a node counts as dead (etcd lease TTL).",
        rich_help_panel=_ELASTIC,
    ),
    stability_window: float = typer.Option(
        1.0, "--stability-window", help="Seconds to wait for more joiners before (re)forming a round.",
        rich_help_panel=_ELASTIC,
    ),
    rescale_timeout: float = typer.Option(
        60.0, "--rescale-timeout", help="Seconds to wait for MIN nodes after losing some.", rich_help_panel=_ELASTIC
    ),
    join_timeout: float = typer.Option(
        600.0, "--join-timeout", help="Seconds to wait for MIN nodes at the start.", rich_help_panel=_ELASTIC
    ),
    shutdown_timeout: float = typer.Option(
        5.0, "--shutdown-timeout", help="Grace between SIGTERM and SIGKILL for workers.", rich_help_panel=_ELASTIC
    ),
    lr_strategy: AdaptationStrategy = typer.Option(
        AdaptationStrategy.LINEAR, "--lr-scaling", help="LR adaptation hint for workers (ELASTICRUN_LR_SCALING).",
        rich_help_panel=_ELASTIC,
    ),
    redistribution: RedistributionType = typer.Option(
        RedistributionType.FULL_RESHUFFLE, "--redistribution",
        help="Data redistribution hint for workers (ELASTICRUN_REDISTRIBUTION).", rich_help_panel=_ELASTIC,
    ),
    log_dir: Optional[str] = typer.Option(
        None, "--log-dir", "--log_dir", help="Write per-attempt, per-rank stdout/stderr files here.",
        rich_help_panel=_LOGS,
    ),
    redirects: str = typer.Option(
        "0", "-r", "--redirects", help="Streams kept off the console (files only): 0 none, 1 out, 2 err, 3 both; "
        "or per rank 0:3,1:1.", rich_help_panel=_LOGS,
    ),
    tee: str = typer.Option(
        "0", "-t", "--tee", help="Streams copied to files as well as the console (same syntax).", rich_help_panel=_LOGS
    ),
    quiet: bool = typer.Option(False, "-q", "--quiet", help="No agent progress lines.", rich_help_panel=_LOGS),
    prewarm: bool = typer.Option(
        True, "--prewarm/--no-prewarm", help="Pre-start worker interpreters (torch imported) during the rendezvous.",
        rich_help_panel=_WORKERS,
    ),
    etcd_user: Optional[str] = ETCD_USER,
    etcd_password: Optional[str] = ETCD_PASSWORD,
    etcd_cacert: Optional[str] = ETCD_CACERT,
    etcd_cert: Optional[str] = ETCD_CERT,
    etcd_key: Optional[str] = ETCD_KEY,
    etcd_binary: Optional[str] = typer.Option(
        None, "--etcd-binary", help="etcd executable for --standalone.", rich_help_panel=_ETCD
    ),
    etcd_timeout: float = typer.Option(
        10.0, "--etcd-timeout", envvar="ELASTICRUN_ETCD_TIMEOUT",
        help="Seconds to keep retrying an unreachable etcd before giving up.", rich_help_panel=_ETCD,
    ),
) -> None:
    from elasticrun.launch.agent import run_agent

    nmin, nmax = parse_nnodes(nnodes)
    nproc, kind = parse_nproc(nproc_per_node)
    if not rdzv_endpoint and nmax == 1:
        standalone = True  # like torchrun: one node needs no external rendezvous
    if standalone and rdzv_id is None:
        rdzv_id = f"standalone-{uuid.uuid4().hex[:8]}"
    cfg = LaunchConfig(
        entrypoint=script,
        args=list(script_args or []),
        module=module,
        no_python=no_python,
        nnodes_min=nmin,
        nnodes_max=nmax,
        nproc_per_node=nproc,
        device_kind=kind,
        heterogeneous=heterogeneous,
        rdzv_endpoint="" if standalone else rdzv_endpoint,
        rdzv_id=rdzv_id or "default",
        standalone=standalone,
        node_id=node_id or default_node_id(),
        local_addr=local_addr,
        max_restarts=max_restarts,
        heartbeat_timeout=heartbeat_timeout,
        stability_window=stability_window,
        rescale_timeout=rescale_timeout,
        join_timeout=join_timeout,
        shutdown_timeout=shutdown_timeout,
        log_dir=log_dir,
        redirects=redirects,
        tee=tee,
        backend=backend,
        lr_strategy=lr_strategy,
        redistribution=redistribution,
        etcd_user=etcd_user,
        etcd_password=etcd_password,
        etcd_cacert=etcd_cacert,
        etcd_cert=etcd_cert,
        etcd_key=etcd_key,
        etcd_binary=etcd_binary,
        etcd_timeout=etcd_timeout,
        quiet=quiet,
        prewarm=prewarm,
    )
    raise typer.Exit(run_agent(cfg))
