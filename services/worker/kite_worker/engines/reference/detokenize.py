"""Turn generated token ids into streamed text: incremental decoding and stop strings.

Pure logic over a tokenizer's `decode`; no torch, no I/O.
"""

from __future__ import annotations

from typing import Callable, Sequence


class IncrementalDetokenizer:
    """Yields only text that is final: a multi-byte character split across tokens is held back until whole.

    Decodes a short window (from `prefix_offset`) rather than the whole output, so the cost per token stays
    constant; the window restarts where the last complete text ended (the approach of vLLM and TGI).
    """

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def add(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return new_text[len(prefix_text):]
        return ""


class StopStringMatcher:
    """Finds stop strings in streamed text and holds back any tail that could still begin one.

    `feed(delta)` returns (text safe to release now, stopped). After a stop, the released text ends right
    before the stop string, which is never sent (OpenAI semantics).
    """

    def __init__(self, stop: Sequence[str]) -> None:
        self._stops = [s for s in stop if s]
        self._pending = ""

    def feed(self, delta: str) -> tuple[str, bool]:
        if not self._stops:
            return delta, False
        self._pending += delta
        cut = min((i for i in (self._pending.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            released, self._pending = self._pending[:cut], ""
            return released, True
        hold = self._longest_partial_stop()
        released = self._pending[:len(self._pending) - hold]
        self._pending = self._pending[len(self._pending) - hold:]
        return released, False

    def flush(self) -> str:
        """Text still held back when generation ends without a stop string."""
        released, self._pending = self._pending, ""
        return released

    def _longest_partial_stop(self) -> int:
        best = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(self._pending)), best, -1):
                if self._pending.endswith(stop[:length]):
                    best = length
                    break
        return best
