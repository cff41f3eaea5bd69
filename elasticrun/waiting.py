"""Saying that a wait goes on: a "still waiting (N s left)" line every few seconds, never a long silence.

A command or an agent that blocks (etcd unreachable, a job that does not answer, nodes that do
not come) says what it waits for when the wait starts; a :class:`Reminder` then says it again
every :data:`EVERY_S` seconds with the time left, so that neither a terminal nor a log goes
quiet for minutes. Loops call :meth:`Reminder.tick` on every turn; a single blocking call runs
inside :meth:`Reminder.running`, which ticks from a helper thread.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

#: Seconds between two "still waiting" lines.
EVERY_S = 5.0

Say = Callable[[str], None]
_SAME: Any = object()  # Reminder.restart: keep the deadline


class Reminder:
    """Says ``still <what> (N s left)`` through ``say`` every ``every`` seconds of a wait.

    ``what`` reads as the wait itself ("waiting for etcd at h:2379"); ``deadline`` is a
    ``clock()`` time (None: no deadline, the line counts the seconds waited instead). With
    ``max_every`` above ``every`` the period doubles after each line up to ``max_every``: a wait
    that may last hours is said often at first, then seldom.
    """

    def __init__(self, say: Say, what: str, deadline: Optional[float] = None, *, every: float = EVERY_S,
                 max_every: Optional[float] = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.say = say
        self.what = what
        self.deadline = deadline
        self.every = every
        self.max_every = max(every, max_every or every)
        self.clock = clock
        self.started = clock()
        self._period = every
        self._next = self.started + every

    def line(self) -> str:
        """The reminder as it is said now."""
        now = self.clock()
        what = self.what if self.what.startswith("waiting") else f"waiting: {self.what}"
        if self.deadline is None:
            return f"still {what} ({now - self.started:.0f} s so far)"
        return f"still {what} ({max(0.0, self.deadline - now):.0f} s left)"

    def restart(self, what: Optional[str] = None, deadline: Any = _SAME) -> None:
        """A new wait (just said): the next reminder comes a full ``every`` from now. ``what`` and
        ``deadline`` (None: none) replace the old ones when given."""
        if what is not None:
            self.what = what
        if deadline is not _SAME:
            self.deadline = deadline
        self.started = self.clock()
        self._period = self.every
        self._next = self.started + self.every

    def tick(self) -> bool:
        """Say the reminder when it is due; True when it was said."""
        now = self.clock()
        if now < self._next:
            return False
        self._period = min(self._period * 2, self.max_every) if self.max_every > self.every else self.every
        self._next = now + self._period
        self.say(self.line())
        return True

    @contextmanager
    def running(self) -> Iterator[Reminder]:
        """Tick from a helper thread while the ``with`` body blocks."""
        done = threading.Event()

        def loop() -> None:
            while not done.wait(max(0.05, self._next - self.clock())):
                self.tick()

        thread = threading.Thread(target=loop, name="elasticrun-reminder", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            done.set()
            thread.join()


__all__ = ["EVERY_S", "Reminder", "Say"]
