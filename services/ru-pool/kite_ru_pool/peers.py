"""Peers: the pool's replicas as this one sees them: the others heard from lately (their heartbeats) and
whether this one answers the `ru-pool` queue group yet (`serving`: a joining replica waits for its
rebuild).

Boundary: a record, synchronous, calling nothing of the pool. The replica layer (replicas.py) and the
service (service.py) keep it; admin.PoolAdmin reads it for `stats` (`replicas`, `serving`).
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger(__name__)

PEER_SILENT_AFTER = 3.0  # heartbeat intervals: a replica not heard for longer is gone


class Peers:
    def __init__(self, instance_id: str, heartbeat_interval_s: float, has_warm: bool) -> None:
        self.instance_id = instance_id
        self.heartbeat_interval_s = heartbeat_interval_s
        self.has_warm = has_warm
        self.serving = False
        self.seen: dict[str, float] = {}  # instance id -> monotonic time of its last heartbeat
        self._logged_replicas = 1
        self._warned_unshared = False

    def heard(self, instance_id: str, draining: bool) -> None:
        """Another replica's heartbeat (a draining one is gone at once)."""
        if draining:
            self.seen.pop(instance_id, None)
        else:
            self.seen[instance_id] = time.monotonic()

    def num_replicas(self) -> int:
        """This replica and the others heard from lately."""
        horizon = time.monotonic() - PEER_SILENT_AFTER * self.heartbeat_interval_s
        for peer in [p for p, seen in self.seen.items() if seen < horizon]:
            del self.seen[peer]
        return 1 + len(self.seen)

    async def watch(self) -> None:
        """Log the number of replicas when it changes (periodic, and on every replica heartbeat)."""
        n = self.num_replicas()
        if n == self._logged_replicas:
            return
        self._logged_replicas = n
        log.info("%d ru-pool replicas (this one and %s)", n, ", ".join(sorted(self.seen)) or "none")
        if n > 1 and not self.has_warm and not self._warned_unshared:
            self._warned_unshared = True
            log.warning("several ru-pool replicas but no warm tier (KITE_REDIS_URL): they share only what "
                        "their hot tiers evict to cold; a block put through one is not found through another "
                        "until then")
