"""The commit fence's rule (elasticrun.job.fence): who is fenced, and what the round record says."""

from __future__ import annotations

import pytest

from elasticrun.job import env as names
from elasticrun.job.fence import fence_identity, fenced_round, refusal
from elasticrun.job.keys import JobKeys

KEY = JobKeys("j").fence


def test_the_current_round_may_commit():
    assert refusal(3, KEY, b'{"round": 3, "members": []}') is None


@pytest.mark.parametrize("value, words", [
    (b'{"round": 4}', "belongs to round 3 but the job is at round 4: a stale round must not commit"),
    (None, "belongs to round 3 but the job is at round None"),  # no topology: not confirmed
    (b'{"round": "4"}', f"the round record at {KEY} is malformed"),
    (b"{trunc", f"the round record at {KEY} is malformed"),
    (b"[1, 2]", f"the round record at {KEY} is malformed"),
])
def test_any_other_record_refuses_the_commit(value, words):
    why = refusal(3, KEY, value)
    assert why is not None and words in why and why.endswith("not committing"), why


def test_only_a_worker_of_a_job_with_etcd_is_fenced():
    worker = {names.ROUND: "2", names.RDZV_ID: "j", names.RDZV_ENDPOINT: "127.0.0.1:2379"}
    assert fenced_round(worker) == 2 and fence_identity(worker) == ("j", 2)
    for missing in worker:
        env = {k: v for k, v in worker.items() if k != missing}
        assert fenced_round(env) is None and fence_identity(env) is None, missing
