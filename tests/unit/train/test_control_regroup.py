"""CheckpointRequests after an in-place re-form: the worker that becomes rank 0 answers requests."""

from __future__ import annotations

from elasticrun.train.control import CheckpointRequests


def test_the_new_rank_0_starts_watching_and_the_others_do_not():
    # An endpoint nobody serves: the watcher retries in the background; nothing here waits on it.
    survivor = CheckpointRequests(endpoint="127.0.0.1:1", job_id="j", rank=1)
    other = CheckpointRequests(endpoint="127.0.0.1:1", job_id="j", rank=2)
    try:
        assert survivor._thread is None and other._thread is None, "only rank 0 watches for requests"
        survivor.regroup(None, rank=0)  # rank 0 left: this survivor is rank 0 of the new round
        other.regroup(None, rank=1)
        assert survivor.rank == 0 and survivor._thread is not None and survivor._thread.is_alive()
        assert other.rank == 1 and other._thread is None
    finally:
        survivor.close(timeout=1.0)
        other.close(timeout=1.0)
