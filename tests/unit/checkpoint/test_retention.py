"""What deleting checkpoints removes, and what retention keeps, decided from a root's entries alone."""

from __future__ import annotations

from typing import Any

import pytest

from elasticrun.checkpoint.format import CheckpointMeta
from elasticrun.checkpoint.retention import incomplete_targets, plan_delete, plan_keep_last
from elasticrun.checkpoint.validate import CheckpointInfo, CheckpointStatus
from elasticrun.errors import CheckpointError

COMPLETE, INCOMPLETE, ALIAS = CheckpointStatus.COMPLETE, CheckpointStatus.INCOMPLETE, CheckpointStatus.ALIAS


def entry(name: str, status: CheckpointStatus = COMPLETE, step: int = 0, **fields: Any) -> CheckpointInfo:
    meta = CheckpointMeta(name, 1, 0.0, {}, {}, None, training_state={"step": step}, seq=step)
    return CheckpointInfo(name, fields.pop("dirname", name), status,
                          meta=meta if status == COMPLETE else None, **fields)


ROOT = [entry("step-1", step=1), entry("step-2", step=2, latest=True), entry("best", ALIAS, alias_of="step-1"),
        entry("step-3", INCOMPLETE), entry("step-4", INCOMPLETE, temporary=True, dirname=".step-4.tmp-ab12")]


def test_names_are_deleted_as_given():
    assert plan_delete(ROOT, ["step-1", "best"], "/r") == ["step-1", "best"]
    assert plan_delete(ROOT, ["step-3", ".step-4.tmp-ab12"], "/r") == ["step-3", ".step-4.tmp-ab12"]
    assert plan_delete(ROOT, ["best"], "/r") == ["best"]  # an alias: the link only


@pytest.mark.parametrize("names, says", [
    (["../etc"], "invalid checkpoint name '../etc'"),
    (["step-9"], "no checkpoint 'step-9' in /r: nothing deleted"),
    ([".hidden"], "invalid checkpoint name '.hidden'"),  # not the temporary directory of a save here
])
def test_names_outside_the_root_or_not_in_it_delete_nothing(names, says):
    with pytest.raises(CheckpointError, match="^" + says.replace("(", r"\(").replace(")", r"\)")):
        plan_delete(ROOT, ["step-1", *names], "/r", force=True)


def test_a_checkpoint_an_alias_points_to_needs_force_or_the_alias_too():
    with pytest.raises(CheckpointError) as err:
        plan_delete(ROOT, ["step-1"], "/r", force_hint="--force")
    assert str(err.value) == ("refusing to delete step-1: the alias(es) best point to it; delete them too, or pass "
                              "--force to leave them dangling")
    assert plan_delete(ROOT, ["step-1"], "/r", force=True) == ["step-1"]


def test_the_last_complete_checkpoint_needs_force():
    with pytest.raises(CheckpointError) as err:
        plan_delete(ROOT, ["step-1", "step-2", "best"], "/r")
    assert str(err.value) == ("refusing to delete step-1, step-2: no complete checkpoint would be left in /r; pass "
                              "force=True if you mean it")
    assert plan_delete(ROOT, ["step-1", "step-2", "best"], "/r", force=True) == ["step-1", "step-2", "best"]
    assert plan_delete(ROOT, ["step-2"], "/r") == ["step-2"]  # step-1 is left


def test_retention_keeps_the_newest_and_whatever_an_alias_points_to():
    root = [entry(f"step-{n}", step=n) for n in range(1, 6)] + [entry("best", ALIAS, alias_of="step-2")]
    assert plan_keep_last(root, 2) == ["step-1", "step-3"]
    assert plan_keep_last(root, 2, protect="step-1") == ["step-3"]
    assert plan_keep_last(root, 9) == []
    with pytest.raises(CheckpointError, match="keep_last must be at least 1"):
        plan_keep_last(root, 0)


def test_incomplete_ones_are_this_formats_only_never_aliases():
    root = ROOT + [entry("configs", INCOMPLETE, ours=False), entry("old", ALIAS, alias_of="gone")]
    assert incomplete_targets(root) == ["step-3", ".step-4.tmp-ab12"]
