"""``elasticrun ckpt``: list, inspect, verify, delete, load (consolidate/reshard) and save checkpoints.

Read commands (list, inspect, verify) take ``--json`` and never import torch. Errors are
CheckpointErrors, printed by ``elasticrun.cli.main`` as one line (exit code 5).
"""

from __future__ import annotations

import datetime
import os
import sys
from typing import Any, Dict, List, Optional

import typer
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table

from elasticrun.checkpoint.format import LATEST, Shard
from elasticrun.checkpoint.retention import delete as delete_checkpoints
from elasticrun.checkpoint.retention import incomplete_targets, plan_keep_last
from elasticrun.checkpoint.storage import get_storage
from elasticrun.checkpoint.validate import CheckpointStatus, read_meta, resolve_name, scan, verify
from elasticrun.cli.console import console, err_console, fail, print_json
from elasticrun.cli.etcd_options import EtcdFlags, with_etcd_flags

app = typer.Typer(help="Manage sharded safetensors checkpoints.", no_args_is_help=True, add_completion=False)

_STATUS_STYLE = {CheckpointStatus.COMPLETE: "green", CheckpointStatus.INCOMPLETE: "yellow", CheckpointStatus.CORRUPT:
                 "bold red", CheckpointStatus.ALIAS: "cyan", CheckpointStatus.PARTIAL: "green"}


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _when(t: Optional[float]) -> str:
    return "-" if not t else datetime.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")


def _progress(total: int, what: str) -> Progress:
    p = Progress(TextColumn(what), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn(),
                 console=err_console, transient=True, disable=not err_console.is_terminal)
    p.add_task(what, total=total)
    return p


def _existing_root(root: str) -> Any:
    storage = get_storage(root)
    if not storage.exists(storage.root):
        fail(f"checkpoint root {root} does not exist: check the path", 5)
    return storage


@app.command("list")
def list_cmd(
    root: Optional[str] = typer.Argument(None, help="Checkpoint root directory or URL (the disk tier)."),
    memory: Optional[bool] = typer.Option(
        None, "--memory/--no-memory", help="Also list the memory tier: the snapshots this machine's elasticrun "
        "agents keep in /dev/shm (yours only) \\[default: on without ROOT, off with it]."),
    job: Optional[str] = typer.Option(None, "--rdzv-id", help="Only the memory snapshots of this job."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """List checkpoints of both tiers: tier, step, epoch, world size, size, created, status; the newest
    complete one of each root is marked. Without ROOT: this machine's memory snapshots."""
    from elasticrun.cli.ckpt_memory import memory_rows

    if root is None and memory is False:
        fail("nothing to list: give a checkpoint ROOT, or --memory for this machine's memory snapshots", 2)
    infos = scan(_existing_root(root)) if root is not None else []
    mem = memory_rows(job_id=job) if (memory if memory is not None else root is None) else None
    if as_json:
        print_json([dict(i.to_json(), tier="disk", root=root) for i in infos] + [r.to_json() for r in mem or []])
        return
    if not infos and root is not None:
        console.print(f"no checkpoints in {escape(root)}")
    if mem is not None and not mem:
        console.print("no memory snapshots on this machine" + (f" for job {escape(job)}" if job else "") +
                      " (no running elasticrun agent of yours keeps any in /dev/shm)")
    if not infos and not mem:
        return
    where = " and ".join(([escape(root)] if root is not None else []) + (["this machine's memory"] if mem else []))
    table = Table(title=f"checkpoints in {where}", title_justify="left")
    for col, kw in (("name", {}), ("tier", {}), ("step", {"justify": "right"}), ("epoch", {"justify": "right"}),
                    ("world", {"justify": "right"}), ("size", {"justify": "right"}), ("created", {}),
                    ("status", {})):
        table.add_column(col, **kw)
    rows = [(i, "disk") for i in infos] + [
        (r.info, f"memory{' replica' if r.kind == 'replica' else ''} [dim](job {escape(r.where.job)}, agent "
                 f"{r.where.agent_pid})[/]") for r in mem or []]
    for i, tier in rows:
        m = i.meta
        status = f"[{_STATUS_STYLE.get(i.status, '')}]{i.status}[/]"
        if i.problem and i.status != CheckpointStatus.COMPLETE:
            status += f" [dim]({escape(i.problem[:80])})[/]"
        name = escape(i.name) + (" [bold cyan]← latest[/]" if i.latest else "")
        if i.temporary:
            name += " [dim](tmp)[/]"
        if i.alias_of is not None:
            name += f" [dim]→ {escape(i.alias_of)} (alias)[/]"
        table.add_row(name, tier, "-" if m is None or m.step is None else str(m.step),
                      "-" if m is None or m.epoch is None else str(m.epoch),
                      "-" if m is None else str(m.world_size), human_bytes(i.size), _when(i.created), status)
    console.print(table)


def _split_desc(entry: Any) -> str:
    n = len(entry.chunks)
    if isinstance(entry.placement, Shard):
        return f"Shard({entry.placement.dim}) over {n} rank{'s' * (n != 1)}"
    return "replicated" + (f", written as {n} row blocks" if n > 1 else f" ({entry.chunks[0].file})" if n else "")


@app.command("inspect")
def inspect_cmd(
    root: str = typer.Argument(..., help="Checkpoint root directory or URL."),
    name: str = typer.Argument(LATEST, help="Checkpoint name (default: latest)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
) -> None:
    """Show a checkpoint's tensors (global shape, dtype, bytes, split), training state and metadata."""
    storage = _existing_root(root)
    name = resolve_name(storage, name)
    meta = read_meta(storage, name)
    if as_json:
        doc = meta.to_json()
        doc.pop("tree", None)
        for n, t in meta.tensors.items():
            doc["tensors"][n]["bytes"] = t.nbytes
        print_json(doc)
        return
    console.print(f"[bold]{escape(name)}[/] — written by {meta.world_size} rank(s) at {_when(meta.created)}, "
                  f"{len(meta.tensors)} tensors, {human_bytes(meta.total_bytes)} in {len(meta.files)} file(s)")
    table = Table(title="tensors", title_justify="left")
    for col in ("name", "dtype", "shape", "bytes", "split"):
        table.add_column(col, justify="right" if col == "bytes" else "left")
    for t in meta.tensors.values():
        table.add_row(escape(t.name), t.dtype, str(list(t.shape)), human_bytes(t.nbytes), _split_desc(t))
    console.print(table)
    for title, data in (("training state", meta.training_state), ("user metadata", meta.user_metadata)):
        if data:
            kv = Table(title=title, title_justify="left", show_header=False)
            kv.add_column("key")
            kv.add_column("value")
            for k, v in data.items():
                kv.add_row(escape(str(k)), escape(str(v)))
            console.print(kv)


@app.command("verify")
def verify_cmd(
    root: str = typer.Argument(..., help="Checkpoint root directory or URL."),
    name: str = typer.Argument(LATEST, help="Checkpoint name (default: latest)."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Re-hash every file against metadata.json; exit 5 on any mismatch or missing file."""
    storage = _existing_root(root)
    name = resolve_name(storage, name)
    meta = read_meta(storage, name)
    total, algos = meta.total_bytes, "/".join(sorted({f.algo.value for f in meta.files.values()})) or "checksum"
    with _progress(total, f"verifying {name}") as progress:
        result = verify(root, name, progress=lambda n: progress.advance(progress.task_ids[0], n))
    if as_json:
        print_json(result.to_json())
    elif result.ok:
        console.print(f"[green]ok[/] {escape(name)}: {result.files_checked} file(s), "
                      f"{human_bytes(result.bytes_checked)} match their {algos}")
    if not result.ok:
        if not as_json:
            for p in result.problems[1:]:
                err_console.print(f"  {escape(p)}", highlight=False)
        fail(f"{result.problems[0]}" + (f" (and {len(result.problems) - 1} more problems)"
                                        if len(result.problems) > 1 else ""), 5)


def _confirm(what: List[str], yes: bool) -> None:
    if yes:
        return
    if not sys.stdin.isatty():
        fail(f"about to delete {', '.join(what)}: pass --yes to confirm when not running interactively", 2)
    if not typer.confirm(f"delete {', '.join(what)}?", default=False):
        fail("nothing deleted", 1)


@app.command("delete")
def delete_cmd(
    root: str = typer.Argument(..., help="Checkpoint root directory or URL."),
    names: Optional[List[str]] = typer.Argument(None, help="Checkpoint names to delete."),
    keep_last: Optional[int] = typer.Option(None, "--keep-last", help="Delete all but the newest K complete ones."),
    incomplete: bool = typer.Option(False, "--incomplete", help="Delete incomplete/corrupt entries (make sure no "
                                    "save is running)."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation."),
    force: bool = typer.Option(False, "--force", help="Allow deleting the last complete checkpoint."),
) -> None:
    """Delete checkpoints by name, by retention (--keep-last K) or the incomplete ones."""
    modes = sum([bool(names), keep_last is not None, incomplete])
    if modes != 1:
        fail("give checkpoint NAMES, --keep-last K or --incomplete (exactly one of them)", 2)
    storage = _existing_root(root)
    infos = scan(storage)
    if keep_last is not None:
        if keep_last < 1:
            fail(f"--keep-last must be at least 1 (got {keep_last}): the newest checkpoint is always kept", 2)
        targets = plan_keep_last(infos, keep_last)
    elif incomplete:
        targets = incomplete_targets(infos)
    else:
        targets = list(dict.fromkeys(names or []))
    if not targets:
        console.print("nothing to delete")
        return
    # Validate (names that escape ROOT, unknown names, the last complete one) before asking.
    from elasticrun.checkpoint.format import validate_name

    temp_dirs = {i.dirname for i in infos if i.temporary}
    for t in targets:
        if t not in temp_dirs:
            validate_name(t)
    known = {i.dirname for i in infos}
    unknown = [t for t in targets if t not in known]
    if unknown:
        fail(f"no checkpoint {unknown[0]!r} in {root}: nothing deleted (see `elasticrun ckpt list {root}`)", 5)
    _confirm(targets, yes)
    deleted = delete_checkpoints(root, targets, force=force)
    for d in deleted:
        console.print(f"deleted {escape(d)}")


@app.command("load")
def load_cmd(
    root: str = typer.Argument(..., help="Checkpoint root directory or URL."),
    name: str = typer.Argument(LATEST, help="Checkpoint name (default: latest)."),
    out: str = typer.Option(..., "--out", "-o", help="Output .safetensors file; or a directory: Hugging Face "
                            "shards (model-0000i-of-0000n.safetensors + index); with --world-size, a checkpoint."),
    only: Optional[str] = typer.Option(None, "--only", help="Keep tensors whose name starts with this prefix."),
    strip_prefix: bool = typer.Option(False, "--strip-prefix", help="Remove the --only prefix from tensor names."),
    max_shard_size: Optional[str] = typer.Option(
        None, "--max-shard-size", help="Split the export into files of at most this size (5GB = 5·10⁹ bytes, "
        "500MB, 2GiB = 2·2³⁰) in the --out directory \\[default for a directory: 5GB]."),
    force: bool = typer.Option(False, "--force", help="Overwrite existing output files."),
    world_size: Optional[int] = typer.Option(None, "--world-size", help="Reshard into a checkpoint for M ranks."),
    out_name: Optional[str] = typer.Option(None, "--name", help="Name of the resharded checkpoint \\[default: same]."),
    no_verify: bool = typer.Option(False, "--no-verify", help="Skip the checksum check of the source."),
) -> None:
    """Export a checkpoint as safetensors for Hugging Face (one file or shards), or reshard it for another
    world size. Nested state dicts have dotted names (model.fc.weight): --only model. --strip-prefix gives
    a model's own names."""
    from elasticrun.checkpoint.consolidate import consolidate, reshard
    from elasticrun.checkpoint.export import parse_max_shard_size

    storage = _existing_root(root)
    name = resolve_name(storage, name)
    total = read_meta(storage, name).total_bytes
    if world_size is not None:
        if only or strip_prefix or max_shard_size:
            fail("--only/--strip-prefix/--max-shard-size apply to exports, not to --world-size resharding", 2)
        with _progress(total, f"resharding {name}") as p:
            new = reshard(root, name, world_size, out, out_name, verify=not no_verify,
                          progress=lambda n: p.advance(p.task_ids[0], n))
        console.print(f"wrote checkpoint {escape(new)} for {world_size} rank(s) in {escape(out)}")
        return
    directory = not out.endswith(".safetensors")
    if directory and os.path.splitext(out.rstrip("/"))[1] and not os.path.isdir(out):
        fail(f"--out {out}: give a .safetensors file name, or a directory for Hugging Face shards", 2)
    limit = parse_max_shard_size(max_shard_size) if max_shard_size is not None else None
    with _progress(total, f"exporting {name}") as p:
        keys = consolidate(root, name, out, only=only, strip_prefix=strip_prefix, verify=not no_verify,
                           progress=lambda n: p.advance(p.task_ids[0], n), max_shard_size=limit, force=force)
    where = f"{escape(out)} (Hugging Face layout)" if directory else escape(out)
    console.print(f"wrote {len(keys)} tensors of {escape(name)} to {where}")


@app.command("save")
@with_etcd_flags
def save_cmd(
    root: Optional[str] = typer.Argument(None, help="With --from: checkpoint root to import into."),
    name: Optional[str] = typer.Argument(None, help="With --from: name of the new checkpoint."),
    from_file: Optional[str] = typer.Option(None, "--from", help="Import a .pt or .safetensors state dict file."),
    checksum: str = typer.Option("crc32", "--checksum", help="With --from: per-file checksum, crc32 or sha256."),
    rdzv_endpoint: Optional[str] = typer.Option(None, "--rdzv-endpoint", help="etcd endpoint(s) of a running job."),
    rdzv_id: Optional[str] = typer.Option(None, "--rdzv-id", help="The running job's id."),
    timeout: float = typer.Option(600.0, "--timeout", help="Seconds to wait for the job's checkpoint."),
    as_json: bool = typer.Option(False, "--json", help="Print the job's answer as JSON."),
    etcd: EtcdFlags = EtcdFlags(),
) -> None:
    """Ask a running job to checkpoint now (--rdzv-endpoint/--rdzv-id), or import a file (--from)."""
    if from_file is not None:
        if rdzv_endpoint or rdzv_id:
            fail("use either --from FILE ROOT NAME or --rdzv-endpoint/--rdzv-id, not both", 2)
        if not root or not name:
            fail("--from FILE needs ROOT and NAME: elasticrun ckpt save --from model.pt ./ckpts imported", 2)
        from elasticrun.checkpoint.consolidate import import_file

        new = import_file(from_file, root, name, checksum=checksum)
        console.print(f"imported {escape(from_file)} as checkpoint {escape(new)}")
        return
    if not rdzv_endpoint or not rdzv_id:
        fail("give --rdzv-endpoint HOST:PORT and --rdzv-id JOB (ask a running job), or --from FILE ROOT NAME", 2)
    if root or name:
        fail("ROOT/NAME are only for --from; the job decides where its checkpoint goes", 2)
    if timeout <= 0:
        fail(f"--timeout must be positive (got {timeout})", 2)
    settings = etcd.settings(rdzv_endpoint)
    answer = request_job_checkpoint(settings, rdzv_id, timeout)
    if as_json:
        print_json(answer)
    else:
        console.print(f"checkpoint [bold]{escape(str(answer.get('name')))}[/] committed in "
                      f"{escape(str(answer.get('root')))} at step {answer.get('step')}")


def request_job_checkpoint(settings: Any, job: str, timeout: float) -> Dict[str, Any]:
    """Put a checkpoint request for ``job`` in etcd and wait (watch) for rank 0's answer.

    ``settings``: an :class:`~elasticrun.job.settings.EtcdSettings` (or, as before, an endpoint string).
    """
    from elasticrun.job.requests import request_checkpoint
    from elasticrun.job.settings import EtcdSettings

    if isinstance(settings, str):
        settings = EtcdSettings(settings)
    with settings.connect(job) as store:
        with _spinner(f"waiting for job {job} to checkpoint"):
            return request_checkpoint(store, job, timeout, where=f" at {settings.endpoints}")


class _spinner:
    def __init__(self, what: str) -> None:
        self._status = err_console.status(what) if err_console.is_terminal else None

    def __enter__(self) -> _spinner:
        if self._status is not None:
            self._status.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._status is not None:
            self._status.__exit__(*exc)
