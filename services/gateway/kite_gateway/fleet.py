"""What the gateway knows about the other services, learned from their heartbeats. Pure state, no I/O."""

from __future__ import annotations

import time
from dataclasses import dataclass

from kite_shared.messages import Heartbeat


@dataclass
class Fleet:
    dead_after_s: float
    _last: dict[tuple[str, str], tuple[float, Heartbeat]] = None  # (service, instance) -> (monotonic, beat)

    def __post_init__(self) -> None:
        self._last = {}

    def observe(self, beat: Heartbeat, now: float | None = None) -> None:
        self._last[(beat.service, beat.instance_id)] = (time.monotonic() if now is None else now, beat)

    def alive(self, service: str, now: float | None = None) -> list[Heartbeat]:
        now = time.monotonic() if now is None else now
        self._forget_dead(now)
        return [beat for (svc, _), (seen, beat) in self._last.items()
                if svc == service and now - seen <= self.dead_after_s and not beat.draining]

    def is_alive(self, service: str, instance_id: str, now: float | None = None) -> bool:
        """Alive even when draining: a draining worker still finishes its streams."""
        now = time.monotonic() if now is None else now
        entry = self._last.get((service, instance_id))
        return entry is not None and now - entry[0] <= self.dead_after_s

    def models(self, now: float | None = None) -> dict[str, int]:
        """Model id -> context window, over live workers: each base, and each adapter under its own name
        and as "<base>:<adapter>"."""
        models = {}
        for beat in self.alive("worker", now):
            if beat.model:
                models[beat.model] = beat.max_context_tokens
                for adapter in beat.adapters:
                    models[adapter] = models[f"{beat.model}:{adapter}"] = beat.max_context_tokens
        return models

    def model_fingerprint(self, model: str, now: float | None = None) -> str | None:
        """The hex fingerprint live fingerprinters compute `model` under; None when none names it or they
        disagree (a rolling update: answers of the old and the new model must not be mixed)."""
        found = {beat.model_fingerprints.get(model) for beat in self.alive("fingerprinter", now)}
        return found.pop() if len(found) == 1 else None

    def _forget_dead(self, now: float) -> None:
        # Keep dead entries a while (is_alive answers False for them), then drop them to bound memory.
        for key in [k for k, (seen, _) in self._last.items() if now - seen > 60 * self.dead_after_s]:
            del self._last[key]
