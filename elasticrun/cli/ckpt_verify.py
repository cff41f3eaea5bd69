"""``elasticrun ckpt verify ROOT [NAME]``: re-hash checkpoints against their ``metadata.json``.

With NAME (or ``latest``) one checkpoint is checked. Without it, every complete checkpoint of
the root is, and every damaged entry (a corrupt checkpoint) counts as a failure too, so a
root whose newest checkpoint is truncated never verifies as fine. Exit 5 when anything is
wrong; the last line on stderr is the one ``elasticrun: error:`` line.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from rich.markup import escape

from elasticrun.checkpoint.storage import Storage
from elasticrun.checkpoint.validate import (
    CheckpointInfo,
    CheckpointStatus,
    VerifyResult,
    is_ordered,
    read_meta,
    scan,
    verify,
)
from elasticrun.cli.ckpt_latest import resolve
from elasticrun.cli.console import console, err_console, fail, print_json, progress, warn
from elasticrun.job.exitcodes import ExitCode
from elasticrun.sizes import format_size


def _algos(storage: Storage, name: str) -> str:
    meta = read_meta(storage, name)
    return "/".join(sorted({f.algo.value for f in meta.files.values()})) or "checksum"


def _check(root: str, storage: Storage, names: List[str]) -> List[VerifyResult]:
    """Re-hash ``names`` with one progress display for all of them."""
    total = sum(read_meta(storage, n).total_bytes for n in names)
    what = f"verifying {names[0]}" if len(names) == 1 else f"verifying {len(names)} checkpoints"
    with progress(total, what) as advance:
        return [verify(root, n, progress=advance) for n in names]


def _damaged(info: CheckpointInfo) -> VerifyResult:
    return VerifyResult(info.name, [info.problem or f"checkpoint {info.name!r} is damaged"])


def to_verify(infos: List[CheckpointInfo]) -> Tuple[List[str], List[CheckpointInfo]]:
    """Of a root's entries: the complete checkpoints to re-hash and the damaged ones (corrupt, not an
    alias or a save in progress), each counted as a failure."""
    complete = [i.name for i in infos if is_ordered(i)]
    damaged = [i for i in infos if i.status == CheckpointStatus.CORRUPT and i.alias_of is None and not i.temporary]
    return complete, damaged


def failure(results: List[VerifyResult]) -> Optional[Tuple[List[str], str]]:
    """What went wrong, or None: the problems before the last one (a line each, above) and the
    one error line (the last problem, with how many checkpoints failed and how many problems more)."""
    bad = [r for r in results if not r.ok]
    if not bad:
        return None
    problems = [p for r in bad for p in r.problems]
    what = f"{len(bad)} of {len(results)} checkpoints failed: " if len(results) > 1 else ""
    more = f" (and {len(problems) - 1} more problem{'s' * (len(problems) > 2)} above)" if len(problems) > 1 else ""
    return problems[:-1], f"{what}{problems[-1]}{more}"


def _verify_all(root: str, storage: Storage) -> Tuple[List[VerifyResult], Dict[str, Any]]:
    """Every checkpoint of ``root`` re-hashed, every damaged entry a failure; the results and their JSON."""
    complete, damaged = to_verify(scan(storage))
    if not complete and not damaged:
        fail(f"no checkpoint in {root} to verify (see `elasticrun ckpt list {root}`)", ExitCode.CHECKPOINT)
    results = (_check(root, storage, complete) if complete else []) + [_damaged(i) for i in damaged]
    return results, {"root": root, "ok": all(r.ok for r in results), "checkpoints": [r.to_json() for r in results]}


def verify_command(root: str, storage: Storage, name: Optional[str], as_json: bool) -> None:
    """Verify checkpoint ``name`` of ``root`` (None: every checkpoint) and report; exit 5 on a problem."""
    if name is not None:
        results = _check(root, storage, [resolve(storage, name, warn)])
        doc: Dict[str, Any] = results[0].to_json()
    else:
        results, doc = _verify_all(root, storage)
    if as_json:
        print_json(doc)
    else:
        for r in results:
            if r.ok:
                console.print(f"[green]ok[/] {escape(r.name)}: {r.files_checked} file(s), "
                              f"{format_size(r.bytes_checked)} match their {_algos(storage, r.name)}")
    wrong = failure(results)
    if wrong is None:
        return
    above, line = wrong
    if not as_json:
        for p in above:
            err_console.print(f"  {escape(p)}", highlight=False, soft_wrap=True)
    fail(line, ExitCode.CHECKPOINT)


__all__ = ["verify_command"]
