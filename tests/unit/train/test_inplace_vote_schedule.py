"""``InPlace(every=K)``: every rank votes at the same calls, so a rank whose SIGTERM lands between two votes
waits for the next scheduled one instead of starting a vote the others never join (a collective mismatch)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import List, Tuple

from elasticrun.train.inplace import _STOP, InPlace, Reform


def _rank(every: int, votes: List[int], others: int) -> InPlace:
    """An enabled InPlace whose vote records this rank's flag and answers as if the other ranks sent ``others``."""
    rank = InPlace.__new__(InPlace)
    rank.ctx = SimpleNamespace(should_stop=False, round=0, distributed=True)
    rank.path, rank._seen, rank.timeout, rank.every = "assignment", None, 30.0, every
    rank._calls, rank._watch, rank.group_kept = 0, None, False
    rank._pending = lambda: False

    def vote(mine: int) -> Tuple[int, int]:
        votes.append(mine)
        return max(mine, others), min(mine, others)

    rank._vote = vote
    return rank


def test_a_sigterm_between_votes_waits_for_the_next_scheduled_vote():
    votes: List[int] = []
    rank = _rank(every=3, votes=votes, others=_STOP)  # the whole job stops: every rank votes STOP at call 3
    assert rank.check() is Reform.CONTINUE
    rank.ctx.should_stop = True  # SIGTERM after call 1
    assert rank.check() is Reform.CONTINUE, "call 2 is off schedule: no vote, whatever this rank's SIGTERM"
    assert votes == []
    assert rank.check() is Reform.STOP
    assert votes == [_STOP] and rank.group_kept, "the scheduled vote: every rank stops together, group kept"


def test_every_rank_votes_at_the_same_calls():
    votes: List[int] = []
    rank = _rank(every=2, votes=votes, others=0)
    results = [rank.check() for _ in range(6)]
    assert results == [Reform.CONTINUE] * 6
    assert votes == [0, 0, 0], "calls 2, 4 and 6 vote, no others"
