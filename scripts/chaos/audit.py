"""Read the chaos soak's worker audit logs: the training lineage, rollbacks, and exactly-once sample checks.

A *generation* is one round, ``(round, restart)``; it begins at one step for all its ranks (``resume``: a
checkpoint; ``reform``: the step the survivors went on from in place). The *lineage* is traced back from the last
generation: each covers ``(begin, last step]`` on the state of the latest earlier generation that reached its
begin; every other logged step was lost. Its steps and samples are checked as docs/reliability.md says.
"""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

Gen = Tuple[int, int]  # (round, restart)


class Tail:
    """Reads the workers' audit logs (``*.jsonl`` in one folder) incrementally, complete lines only."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.offsets: Dict[str, int] = {}
        self.records: List[dict] = []

    def poll(self) -> List[dict]:
        """The lines written since the last poll, in time order (also appended to ``records``)."""
        new: List[dict] = []
        for path in sorted(self.directory.glob("*.jsonl")):
            with open(path, "rb") as f:
                f.seek(self.offsets.get(path.name, 0))
                data = f.read()
            end = data.rfind(b"\n") + 1
            self.offsets[path.name] = self.offsets.get(path.name, 0) + end
            for line in data[:end].splitlines():
                try:
                    new.append(json.loads(line))
                except ValueError:
                    continue
        new.sort(key=lambda r: r["t"])
        self.records.extend(new)
        return new


def gen_of(record: dict) -> Gen:
    return (int(record["round"]), int(record["restart"]))


@dataclass
class Segment:
    gen: Gen
    first: int  # first step (inclusive)
    last: int  # last step (inclusive)


@dataclass
class AuditResult:
    """What the audit logs say about the whole run."""

    lineage: List[Segment] = field(default_factory=list)
    final_step: int = 0
    steps_executed: int = 0  # distinct (generation, step) pairs
    steps_lost: int = 0
    generations: int = 0
    samples_checked: int = 0
    samples_twice: int = 0
    samples_skipped: int = 0
    samples_unlogged: int = 0  # a killed rank's last step, carried on in place (docs/reliability.md)
    epochs_checked: int = 0
    problems: List[str] = field(default_factory=list)
    saves: List[Tuple[float, int, str]] = field(default_factory=list)  # (t, step, name) by rank 0
    save_failures: List[Tuple[float, int, str]] = field(default_factory=list)
    resumes: List[Tuple[float, Gen, int, Optional[str]]] = field(default_factory=list)  # one per generation


def _permutation(n: int, seed: int, epoch: int) -> List[int]:
    import torch

    g = torch.Generator()
    g.manual_seed(seed + int(epoch))
    return torch.randperm(n, generator=g).tolist()


def analyse(records: List[dict], dataset_size: int, seed: int) -> AuditResult:
    """Lineage, rollbacks and the sample audit; ``problems`` lists every violation found."""
    res = AuditResult()
    steps: Dict[Gen, Dict[int, List[dict]]] = defaultdict(lambda: defaultdict(list))
    begin: Dict[Gen, List[int]] = defaultdict(list)  # each rank's first step - 1: resumed, or re-formed at
    in_place: Set[Gen] = set()  # generations that began by re-forming in place
    for r in records:
        ev = r.get("ev")
        if ev == "step":
            steps[gen_of(r)][int(r["step"])].append(r)
        elif ev in ("resume", "reform"):
            if ev == "resume" and gen_of(r) not in begin:
                res.resumes.append((r["t"], gen_of(r), int(r["step"]), r.get("name")))
            begin[gen_of(r)].append(int(r["step"]))
            if ev == "reform":
                in_place.add(gen_of(r))
        elif ev == "save" and int(r["rank"]) == 0:
            res.saves.append((r["t"], int(r["step"]), str(r["name"])))
        elif ev == "save_failed" and int(r["rank"]) == 0:
            res.save_failures.append((r["t"], int(r["step"]), str(r.get("error", ""))))
    res.generations = len(steps)
    res.steps_executed = sum(len(s) for s in steps.values())
    res.problems += [f"generation {gen}: ranks began at different steps {sorted(set(starts))}"
                     for gen, starts in begin.items() if len(set(starts)) > 1]
    if not steps:
        res.problems.append("no training step was logged")
        return res
    _trace_lineage(res, steps, begin)
    res.lineage.reverse()
    res.steps_lost = res.steps_executed - sum(s.last - s.first + 1 for s in res.lineage)
    _check_samples(res, steps, dataset_size, seed, in_place)
    return res


def _trace_lineage(res: AuditResult, steps: Dict[Gen, Dict[int, List[dict]]], begin: Dict[Gen, List[int]]) -> None:
    """Walk back from the last generation to step 0 (see the module doc), into ``res.lineage`` (newest first)."""
    order = sorted(steps)
    cur: Optional[Gen] = order[-1]
    upper = res.final_step = max(steps[order[-1]])
    while cur is not None:
        lo = min(begin.get(cur, [min(steps[cur]) - 1]))
        res.lineage.append(Segment(cur, lo + 1, upper))
        missing = [s for s in range(lo + 1, upper + 1) if s not in steps[cur]]
        if missing:
            res.problems.append(f"generation {cur} skipped steps {missing[:5]} (began at {lo})")
        if lo <= 0:
            break
        earlier = [g for g in order if g < cur and lo in steps[g]]
        if not earlier:
            res.problems.append(f"generation {cur} began at step {lo}, which no earlier generation logged")
            break
        cur, upper = earlier[-1], lo


def _logged_by(recs: List[dict], world: int, went_on_in_place: bool) -> Optional[bool]:
    """Whether a lineage step's lines are right: True when every rank of one ``world`` logged it; None when
    some ranks are missing at a step the next generation went on from in place (their samples are unlogged,
    not skipped: docs/reliability.md); False otherwise (a violation)."""
    ranks = sorted(int(r["rank"]) for r in recs)
    if any(int(r["world"]) != world for r in recs) or not set(ranks) <= set(range(world)):
        return False
    if ranks == list(range(world)):
        return True
    return None if went_on_in_place and len(set(ranks)) == len(ranks) else False


def _check_samples(res: AuditResult, steps: Dict[Gen, Dict[int, List[dict]]], n: int, seed: int,
                   in_place: Set[Gen]) -> None:
    """Each epoch's samples over the lineage against the consumed prefix of its permutation plus the padding."""
    seen: Dict[int, Counter] = defaultdict(Counter)
    consumed: Dict[int, int] = {}
    pad: Dict[int, int] = {}
    for n_seg, seg in enumerate(res.lineage):
        carried_on = n_seg + 1 < len(res.lineage) and res.lineage[n_seg + 1].gen in in_place
        first_in_epoch: Dict[int, int] = {}
        for step in range(seg.first, seg.last + 1):
            recs = steps[seg.gen].get(step, [])
            if not recs:
                continue
            world, epoch = int(recs[0]["world"]), int(recs[0]["epoch"])
            first_in_epoch.setdefault(epoch, consumed.get(epoch, 0))
            after = max(int(r["after"]) for r in recs)
            for r in recs:
                seen[epoch].update(int(i) for i in r["idx"])
            ok = _logged_by(recs, world, carried_on and step == seg.last)
            if ok is None:
                logged = {int(i) for r in recs for i in r["idx"]}
                unlogged = [i for i in _permutation(n, seed, epoch)[consumed.get(epoch, 0):after] if i not in logged]
                seen[epoch].update(unlogged)
                res.samples_unlogged += len(unlogged)
            elif not ok:
                ranks, worlds = sorted(int(r["rank"]) for r in recs), sorted({int(r["world"]) for r in recs})
                res.problems.append(f"step {step} of generation {seg.gen}: logged by ranks {ranks} of {worlds}")
            consumed[epoch] = after
            if consumed[epoch] >= n and epoch not in pad:
                rem = n - first_in_epoch[epoch]
                pad[epoch] = math.ceil(rem / world) * world - rem
    for epoch in sorted(seen):
        _check_epoch(res, epoch, seen[epoch], n, seed, consumed[epoch], pad.get(epoch, 0))


def _check_epoch(res: AuditResult, epoch: int, counts: Counter, n: int, seed: int, consumed: int, pad: int) -> None:
    """One epoch's samples (``counts``) against the consumed prefix of its permutation plus ``pad`` repeats."""
    expected = set(_permutation(n, seed, epoch)[:consumed])
    skipped, extra = len(expected - set(counts)), len(set(counts) - expected)
    twice = sum(c - 1 for c in counts.values()) - pad
    res.epochs_checked += 1
    res.samples_checked += sum(counts.values())
    res.samples_skipped += skipped
    res.samples_twice += max(0, twice) + extra
    if skipped or twice > 0 or extra:
        res.problems.append(f"epoch {epoch}: {skipped} sample(s) skipped, {max(0, twice)} seen twice, {extra} "
                            f"outside the consumed prefix (consumed {consumed} of {n})")
    elif twice < 0:
        res.problems.append(f"epoch {epoch}: fewer repeats ({twice + pad}) than the sampler's end-of-epoch padding "
                            f"({pad})")
