"""``elasticrun check``: this node's pre-flight check, as a table (or ``--json``); exit 6 when a check fails.

The measuring and judging live in :mod:`elasticrun.health`; this module is the command: flags (one
per threshold, see :class:`~elasticrun.health.thresholds.Thresholds`), the etcd connection for the
round trip, and the output.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
from typing import Any, Callable, Dict, Optional

import typer
from rich.text import Text

from elasticrun.cli import values
from elasticrun.cli.console import console, note, print_json
from elasticrun.cli.etcd_options import EtcdFlags, with_etcd_flags
from elasticrun.cli.tables import Column, DataTable
from elasticrun.errors import ElasticrunError
from elasticrun.health.node import SHM_DIR, CheckPlan, NodeReport, run_check
from elasticrun.health.thresholds import Thresholds
from elasticrun.health.verdict import Verdict
from elasticrun.job import env as job_env
from elasticrun.job.exitcodes import ExitCode
from elasticrun.job.keys import JobKeys

HELP = """Check this node before it trains: CPU, storage, etcd, GPUs (exit 6 when a check fails).

  elasticrun check                                        # CPU, ./ and /dev/shm, GPUs when there are any
  elasticrun check --ckpt-dir /mnt/ckpt --rdzv-endpoint etcd:2379
  elasticrun check --json                                 # one JSON document
  elasticrun check --min-cpu-gflops 20 --max-gpu-temp-c 80   # your fleet's thresholds

Checks: single-thread CPU matmul speed; free space and fsync'd write speed of the checkpoint
directory and /dev/shm; the etcd round trip (with --rdzv-endpoint); on GPU nodes NVML (uncorrected
ECC errors, retired pages and remapped rows, temperature, hardware/thermal throttling, free memory,
XID errors seen while checking), a bf16 matmul per GPU against its model's expected speed, and an
NCCL all-reduce across the GPUs (gloo between two processes on a CPU node). Thresholds and measured
figures: docs/reliability.md.
"""

_RESULT_STYLE = {Verdict.PASS: "green", Verdict.FAIL: "bold red", Verdict.SKIP: "dim"}


def _threshold_help(name: str, default: float) -> str:
    words = name.replace("_", " ").replace("min ", "minimum ").replace("max ", "maximum ")
    return f"Threshold: {words} \\[default: {default:g}]."


def with_threshold_flags(command: Callable[..., Any]) -> Callable[..., Any]:
    """Give ``command`` one ``--<threshold>`` option per :class:`Thresholds` field (as text: checked by
    :meth:`Thresholds.with_overrides`, one line on a bad value); it is called with ``thresholds``."""
    defaults = Thresholds()
    fields = [f.name for f in dataclasses.fields(Thresholds)]
    sig = inspect.signature(command)
    own = [p for p in sig.parameters.values() if p.name != "thresholds"]
    added = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=Optional[str],
                               default=typer.Option(None, Thresholds.flag(name), metavar="N",
                                                    help=_threshold_help(name, getattr(defaults, name)),
                                                    rich_help_panel="Thresholds"))
             for name in fields]

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        kwargs["thresholds"] = defaults.with_overrides({name: kwargs.pop(name, None) for name in fields})
        return command(*args, **kwargs)

    del wrapper.__wrapped__  # type: ignore[attr-defined]
    wrapper.__signature__ = sig.replace(parameters=[*own, *added])  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in [*own, *added]}
    return wrapper


def render_report(report: NodeReport) -> DataTable:
    """The report as a table: check, figure, threshold, result, detail (every text verbatim)."""
    table = DataTable([Column("check", name=True), Column("figure", justify="right"), Column("threshold"),
                       Column("result"), Column("detail", prose=True)],
                      title="node check: " + ("passed" if report.passed else "FAILED"))
    for c in report.checks:
        figure = "" if c.figure is None else f"{c.figure:g} {c.unit}"
        table.add_row(c.name, figure, f"{c.threshold} {c.unit}".strip() if c.threshold else "",
                      Text(c.verdict.value, style=_RESULT_STYLE[c.verdict]), c.detail)
    return table


def _etcd_read(endpoint: str, job: Optional[str], etcd: EtcdFlags, timeout: float) -> Optional[Callable[[], Any]]:
    """One read of the job's etcd (a key never written), or a function raising why etcd cannot be used."""
    if not endpoint:
        return None
    try:
        store = etcd.settings(endpoint, retry_timeout=timeout).connect(job, timeout=timeout)
    except ElasticrunError as err:
        message = str(err)

        def unreachable() -> Any:
            raise ElasticrunError(message)

        return unreachable
    key = JobKeys(job or "elasticrun-check").ping
    return lambda: store.get(key)


@with_threshold_flags
@with_etcd_flags
def check(
    ckpt_dir: str = typer.Option(os.environ.get(job_env.CHECKPOINT_DIR) or ".", "--ckpt-dir",
                                 help="Checkpoint directory to check (free space, write speed) "
                                      "\\[default: $ELASTICRUN_CHECKPOINT_DIR, else .]."),
    shm_dir: str = typer.Option(SHM_DIR, "--shm-dir", help="Shared-memory directory to check."),
    rdzv_endpoint: str = typer.Option(
        "", "--rdzv-endpoint", "--rdzv_endpoint", envvar=job_env.RDZV_ENDPOINT, callback=values.endpoints,
        help="etcd endpoints host:port[,host:port...]: measure the round trip \\[default: not checked].",
    ),
    rdzv_id: Optional[str] = typer.Option(None, "--rdzv-id", "--rdzv_id",
                                          help="Job whose prefix the etcd read uses (a job's etcd user reads it)."),
    gpu: bool = typer.Option(True, "--gpu/--no-gpu", help="Check the GPUs when the node has any."),
    allreduce: bool = typer.Option(True, "--allreduce/--no-allreduce", help="Run the loopback all-reduce."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document instead of the table."),
    timeout: float = typer.Option(5.0, "--timeout", callback=values.seconds(),
                                  help="Seconds to wait for etcd before its check fails."),
    etcd: EtcdFlags = EtcdFlags(),
    thresholds: Thresholds = Thresholds(),
) -> None:
    plan = CheckPlan(ckpt_dir=ckpt_dir, shm_dir=shm_dir, endpoint=rdzv_endpoint, thresholds=thresholds,
                     etcd_read=_etcd_read(rdzv_endpoint, rdzv_id, etcd, timeout), gpu=gpu, allreduce=allreduce)
    if not as_json:
        note("checking this node (CPU, storage, etcd, GPUs): about 10-30 s")
    report = run_check(plan)
    if as_json:
        doc: Dict[str, Any] = dict(report.to_dict(), thresholds=thresholds.to_dict())
        print_json(doc)
    else:
        console.print(render_report(report))
    if not report.passed:
        raise typer.Exit(ExitCode.NODE_UNHEALTHY)


__all__ = ["HELP", "check", "render_report", "with_threshold_flags"]
