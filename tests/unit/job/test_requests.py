"""The checkpoint-request protocol's rule for a job that cannot answer (elasticrun.job.requests)."""

from __future__ import annotations

from elasticrun.job.requests import why_gone


def test_a_running_job_can_answer():
    assert why_gone("j", None, running_nodes=2) is None


def test_an_ended_job_says_how_it_ended():
    state = {"state": "failed", "reason": "worker 1 exited 3", "time": 0}
    assert why_gone("j", state, running_nodes=2) == \
        "job 'j' finished at 1970-01-01 00:00:00 UTC (failed: worker 1 exited 3)"


def test_a_job_without_nodes_has_no_one_to_answer():
    assert why_gone("j", None, running_nodes=0) == "job 'j' has no running node (its agents stopped or were lost)"
