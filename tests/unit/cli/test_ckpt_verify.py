"""``ckpt verify``'s error line from the results (elasticrun.cli.ckpt_verify.failure): no files."""

from __future__ import annotations

from elasticrun.checkpoint.validate import VerifyResult
from elasticrun.cli.ckpt_verify import failure


def test_all_good_is_no_failure() -> None:
    assert failure([VerifyResult("step-1"), VerifyResult("step-2")]) is None
    assert failure([]) is None


def test_one_checkpoint_one_problem_is_the_line() -> None:
    assert failure([VerifyResult("step-1", ["shard-0 hash mismatch"])]) == ([], "shard-0 hash mismatch")


def test_the_last_problem_is_the_line_the_others_go_above() -> None:
    results = [VerifyResult("step-1"), VerifyResult("step-2", ["a bad", "b bad"]), VerifyResult("step-3", ["c bad"])]
    assert failure(results) == (["a bad", "b bad"], "2 of 3 checkpoints failed: c bad (and 2 more problems above)")
    two = [VerifyResult("step-1", ["a bad"]), VerifyResult("step-2", ["b bad"])]
    assert failure(two) == (["a bad"], "2 of 2 checkpoints failed: b bad (and 1 more problem above)")
