"""``elasticrun ckpt``: list, inspect, verify, delete, load (consolidate/reshard) and save checkpoints.

Read commands (list, inspect, verify) take ``--json`` and never import torch. Errors are
CheckpointErrors, printed by ``elasticrun.cli.main`` as one line (exit code 5).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Dict, List, Optional

import typer
from rich.text import Text

from elasticrun.checkpoint.format import LATEST, Shard
from elasticrun.checkpoint.retention import delete as delete_checkpoints
from elasticrun.checkpoint.retention import incomplete_targets, plan_keep_last
from elasticrun.checkpoint.storage import Storage, get_storage
from elasticrun.checkpoint.validate import read_meta, scan
from elasticrun.cli import values
from elasticrun.cli.ckpt_latest import resolve
from elasticrun.cli.ckpt_list import listing_json, listing_table, plan_listing, shows_memory
from elasticrun.cli.console import console, fail, local_time, note, print_json, progress, warn
from elasticrun.cli.etcd_options import EtcdFlags, with_etcd_flags
from elasticrun.cli.tables import Column, DataTable
from elasticrun.cli.typer_help import HelpCommand, HelpGroup
from elasticrun.job import env as job_env
from elasticrun.job.exitcodes import ExitCode
from elasticrun.job.keys import JobKeys
from elasticrun.sizes import format_size
from elasticrun.store.reach import wait_for_etcd
from elasticrun.store.settings import EtcdSettings
from elasticrun.waiting import Reminder

app = typer.Typer(help="Manage sharded safetensors checkpoints.", no_args_is_help=True, add_completion=False,
                  cls=HelpGroup)

def _existing_root(root: str) -> Storage:
    storage = get_storage(root)
    if not storage.exists(storage.root):
        fail(f"checkpoint root {root} does not exist: check the path", ExitCode.CHECKPOINT)
    return storage


@app.command("list", cls=HelpCommand)
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
        fail("nothing to list: give a checkpoint ROOT, or --memory for this machine's memory snapshots",
             ExitCode.USAGE)
    infos = scan(_existing_root(root)) if root is not None else []
    mem = memory_rows(job_id=job) if shows_memory(root, memory) else None
    if as_json:
        print_json(listing_json(root, infos, mem))
        return
    listing = plan_listing(root, infos, mem, job)
    for line in listing.notes:
        console.print(Text(line))
    if listing.rows:
        console.print(listing_table(listing))


def _split_desc(entry: Any) -> str:
    n = len(entry.chunks)
    if isinstance(entry.placement, Shard):
        return f"Shard({entry.placement.dim}) over {n} rank{'s' * (n != 1)}"
    return "replicated" + (f", written as {n} row blocks" if n > 1 else f" ({entry.chunks[0].file})" if n else "")


@app.command("inspect", cls=HelpCommand)
def inspect_cmd(
    root: str = typer.Argument(..., help="Checkpoint root directory or URL."),
    name: str = typer.Argument(LATEST, help="Checkpoint name (default: latest)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
) -> None:
    """Show a checkpoint's tensors (global shape, dtype, bytes, split), training state and metadata."""
    storage = _existing_root(root)
    name = resolve(storage, name, warn)
    meta = read_meta(storage, name)
    if as_json:
        doc = meta.to_json()
        doc.pop("tree", None)
        for n, t in meta.tensors.items():
            doc["tensors"][n]["bytes"] = t.nbytes
        print_json(doc)
        return
    n = len(meta.tensors)
    console.print(Text.assemble((name, "bold"), f" — written by {meta.world_size} rank(s) at "
                                f"{local_time(meta.created)}, {n} tensor{'s' * (n != 1)}, "
                                f"{format_size(meta.total_bytes)} in {len(meta.files)} file(s)"))
    table = DataTable([Column("name", name=True), Column("dtype"), Column("shape"), Column("bytes", "right"),
                       Column("split", prose=True)], title="tensors")
    for t in meta.tensors.values():
        table.add_row(t.name, t.dtype, str(list(t.shape)), format_size(t.nbytes), _split_desc(t))
    console.print(table)
    for title, data in (("training state", meta.training_state), ("user metadata", meta.user_metadata)):
        if data:
            kv = DataTable([Column("key", name=True), Column("value", prose=True)], title=title)
            for k, v in data.items():
                kv.add_row(str(k), str(v))
            console.print(kv)


@app.command("verify", cls=HelpCommand)
def verify_cmd(
    root: str = typer.Argument(..., help="Checkpoint root directory or URL."),
    name: Optional[str] = typer.Argument(None, help="Checkpoint name, or latest \\[default: every checkpoint of "
                                         "ROOT]."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Re-hash every file against metadata.json: one checkpoint, or every checkpoint of ROOT (a damaged
    one fails too); exit 5 on any mismatch or missing file."""
    from elasticrun.cli.ckpt_verify import verify_command

    verify_command(root, _existing_root(root), name, as_json)


def _confirm(what: List[str], yes: bool) -> None:
    if yes:
        return
    if not sys.stdin.isatty():
        fail(f"about to delete {', '.join(what)}: pass --yes to confirm when not running interactively",
             ExitCode.USAGE)
    if not typer.confirm(f"delete {', '.join(what)}?", default=False):
        console.print("nothing deleted")  # the answer was no: nothing went wrong
        raise SystemExit(ExitCode.SUCCEEDED)


@app.command("delete", cls=HelpCommand)
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
        fail("give checkpoint NAMES, --keep-last K or --incomplete (exactly one of them)", ExitCode.USAGE)
    if keep_last is not None and keep_last < 1:
        fail(f"--keep-last must be at least 1 (got {keep_last}): the newest checkpoint is always kept",
             ExitCode.USAGE)
    storage = _existing_root(root)
    infos = scan(storage)
    if keep_last is not None:
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
        fail(f"no checkpoint {unknown[0]!r} in {root}: nothing deleted (see `elasticrun ckpt list {root}`)",
             ExitCode.CHECKPOINT)
    _confirm(targets, yes)
    deleted = delete_checkpoints(root, targets, force=force, force_hint="--force")
    for d in deleted:
        console.print(Text(f"deleted {d}"))


@app.command("load", cls=HelpCommand)
def load_cmd(
    root: str = typer.Argument(..., help="Checkpoint root directory or URL."),
    name: str = typer.Argument(LATEST, help="Checkpoint name (default: latest)."),
    out: str = typer.Option(..., "--out", "-o", help="Output .safetensors file; or a directory: Hugging Face "
                            "shards (model-0000i-of-0000n.safetensors + index); with --world-size, a checkpoint."),
    only: Optional[str] = typer.Option(None, "--only", help="Keep tensors whose name starts with this prefix."),
    strip_prefix: bool = typer.Option(False, "--strip-prefix", help="Remove the --only prefix from tensor names."),
    max_shard_size: Optional[str] = typer.Option(
        None, "--max-shard-size", callback=values.size(), metavar="SIZE", help="Split the export into files of at "
        "most this size (5GB = 5·10⁹ bytes, 500MB, 2GiB = 2·2³⁰) in the --out directory \\[default for a "
        "directory: 5GB]."),
    force: bool = typer.Option(False, "--force", help="Overwrite existing output files."),
    world_size: Optional[int] = typer.Option(None, "--world-size", min=1, metavar="M",
                                             help="Reshard into a checkpoint for M ranks."),
    out_name: Optional[str] = typer.Option(None, "--name", help="Name of the resharded checkpoint \\[default: same]."),
    no_verify: bool = typer.Option(False, "--no-verify", help="Skip the checksum check of the source."),
) -> None:
    """Export a checkpoint as safetensors for Hugging Face (one file or shards), or reshard it for another
    world size. Nested state dicts have dotted names (model.fc.weight): --only model. --strip-prefix gives
    a model's own names."""
    storage = _existing_root(root)
    if world_size is not None and (only or strip_prefix or max_shard_size):
        fail("--only/--strip-prefix/--max-shard-size apply to exports, not to --world-size resharding",
             ExitCode.USAGE)
    directory = not out.endswith(".safetensors")
    if world_size is None and directory and os.path.splitext(out.rstrip("/"))[1] and not os.path.isdir(out):
        fail(f"--out {out}: give a .safetensors file name, or a directory for Hugging Face shards", ExitCode.USAGE)
    name = resolve(storage, name, warn)
    total = read_meta(storage, name).total_bytes
    from elasticrun.checkpoint.consolidate import consolidate, reshard  # imports torch: after the checks

    if world_size is not None:
        with progress(total, f"resharding {name}") as advance:
            new = reshard(root, name, world_size, out, out_name, verify=not no_verify, progress=advance)
        console.print(Text(f"wrote checkpoint {new} for {world_size} rank(s) in {out}"))
        return
    limit = int(max_shard_size) if max_shard_size is not None else None  # parsed by values.size
    with progress(total, f"exporting {name}") as advance:
        keys = consolidate(root, name, out, only=only, strip_prefix=strip_prefix, verify=not no_verify,
                           progress=advance, max_shard_size=limit, force=force)
    where = f"{out} (Hugging Face layout)" if directory else out
    console.print(Text(f"wrote {len(keys)} tensor{'s' * (len(keys) != 1)} of {name} to {where}"))


@app.command("save", cls=HelpCommand)
@with_etcd_flags
def save_cmd(
    root: Optional[str] = typer.Argument(None, help="With --from: checkpoint root to import into."),
    name: Optional[str] = typer.Argument(None, help="With --from: name of the new checkpoint."),
    from_file: Optional[str] = typer.Option(None, "--from", help="Import a .pt or .safetensors state dict file."),
    checksum: str = typer.Option("crc32", "--checksum", help="With --from: per-file checksum, crc32 or sha256."),
    rdzv_endpoint: Optional[str] = typer.Option(None, "--rdzv-endpoint", callback=values.endpoints,
                                                help="etcd endpoint(s) of a running job."),
    rdzv_id: Optional[str] = typer.Option(None, "--rdzv-id", help="The running job's id."),
    timeout: float = typer.Option(600.0, "--timeout", callback=values.seconds(),
                                  help="Seconds to wait for the job's checkpoint."),
    etcd_timeout: float = typer.Option(10.0, "--etcd-timeout", envvar=job_env.ETCD_TIMEOUT, callback=values.seconds(),
                                       help="Seconds to keep trying an unreachable etcd."),
    as_json: bool = typer.Option(False, "--json", help="Print the job's answer as JSON."),
    etcd: EtcdFlags = EtcdFlags(),
) -> None:
    """Ask a running job to checkpoint now (--rdzv-endpoint/--rdzv-id), or import a file (--from)."""
    if from_file is not None:
        if rdzv_endpoint or rdzv_id:
            fail("use either --from FILE ROOT NAME or --rdzv-endpoint/--rdzv-id, not both", ExitCode.USAGE)
        if not root or not name:
            fail("--from FILE needs ROOT and NAME: elasticrun ckpt save --from model.pt ./ckpts imported",
                 ExitCode.USAGE)
        from elasticrun.checkpoint.consolidate import import_file

        new = import_file(from_file, root, name, checksum=checksum)
        console.print(Text(f"imported {from_file} as checkpoint {new}"))
        return
    if not rdzv_endpoint or not rdzv_id:
        fail("give --rdzv-endpoint HOST:PORT and --rdzv-id JOB (ask a running job), or --from FILE ROOT NAME",
             ExitCode.USAGE)
    if root or name:
        fail("ROOT/NAME are only for --from; the job decides where its checkpoint goes", ExitCode.USAGE)
    settings = etcd.settings(rdzv_endpoint, retry_timeout=etcd_timeout)
    answer = request_job_checkpoint(settings, rdzv_id, timeout)
    if as_json:
        print_json(answer)
    else:
        console.print(Text.assemble("checkpoint ", (str(answer.get("name")), "bold"),
                                    f" committed in {answer.get('root')} at step {answer.get('step')}"))


def request_job_checkpoint(settings: EtcdSettings, job: str, timeout: float) -> Dict[str, Any]:
    """Put a checkpoint request for ``job`` in etcd and wait (watch) for rank 0's answer, saying every
    few seconds how long it still waits (on stderr; no waiting is ever silent)."""
    from elasticrun.cli.ckpt_request import request_checkpoint

    left = wait_for_etcd(settings.endpoints, settings.retry_timeout, note)
    with settings.connect(JobKeys(job).ping, retry_timeout=max(1.0, left)) as store:
        what = f"waiting for job {job} to checkpoint"
        note(f"{what} (up to {timeout:g} s, --timeout)")
        with Reminder(note, what, time.monotonic() + timeout).running():
            return request_checkpoint(store, job, timeout, where=f" at {settings.endpoints}")
