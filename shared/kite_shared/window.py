"""Figures over the last `window_s` seconds (KITE_TELEMETRY_WINDOW_S) for telemetry: rates, sums, percentiles.
Pure: the caller passes the monotonic time, so tests drive the clock."""

from __future__ import annotations

import math
from collections import deque


class TimeWindow:
    """Samples (a value each) observed within the last `window_s` seconds."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque()  # (monotonic seconds, value)

    def add(self, now: float, value: float = 1.0) -> None:
        self._samples.append((now, value))

    def _expire(self, now: float) -> None:
        while self._samples and now - self._samples[0][0] > self.window_s:
            self._samples.popleft()

    def count(self, now: float) -> int:
        self._expire(now)
        return len(self._samples)

    def rate(self, now: float) -> float:
        """Samples per second over the window."""
        return self.count(now) / self.window_s

    def total(self, now: float) -> float:
        self._expire(now)
        return sum(v for _, v in self._samples)

    def percentile(self, now: float, q: float) -> float:
        """The nearest-rank q-quantile (0 < q <= 1) of the values; 0.0 when there are none."""
        self._expire(now)
        if not self._samples:
            return 0.0
        values = sorted(v for _, v in self._samples)
        return values[max(0, math.ceil(q * len(values)) - 1)]
