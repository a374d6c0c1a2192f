"""Up/down state of a remote tier with exponential backoff. Pure: the clock is injected.

A tier that fails or times out is marked down; while down, callers skip it (a miss, no I/O) until the
backoff has passed, then exactly one caller gets to try (a probe). Success brings the tier back and
resets the backoff; failure doubles it up to the maximum.
"""

from __future__ import annotations

import time
from typing import Callable


class TierHealth:
    def __init__(self, name: str, initial_backoff_s: float = 0.5, max_backoff_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.initial_backoff_s = initial_backoff_s
        self.max_backoff_s = max(max_backoff_s, initial_backoff_s)
        self._clock = clock
        self.up = True
        self.backoff_s = 0.0
        self.retry_at = 0.0
        self._probing = False
        self.failures = 0  # lifetime count of failed operations

    def should_try(self) -> bool:
        """True when an operation may go to the tier now (up, or the one probe after the backoff)."""
        if self.up:
            return True
        if self._probing or self._clock() < self.retry_at:
            return False
        self._probing = True
        return True

    def failure(self) -> bool:
        """Record a failed operation; True when this took the tier from up to down."""
        self.failures += 1
        was_up = self.up
        self.up = False
        self._probing = False
        self.backoff_s = (self.initial_backoff_s if was_up or self.backoff_s == 0
                          else min(self.backoff_s * 2, self.max_backoff_s))
        self.retry_at = self._clock() + self.backoff_s
        return was_up

    def success(self) -> bool:
        """Record a successful operation; True when this brought the tier back up."""
        recovered = not self.up
        self.up = True
        self._probing = False
        self.backoff_s = 0.0
        self.retry_at = 0.0
        return recovered

    def release_probe(self) -> None:
        """The probe was abandoned (cancelled) without an outcome: let the next caller probe."""
        self._probing = False
