"""The audit trail of each namespace (issue 16): a model fingerprint, naming a base or an adapter under one
execution path. Pure bookkeeping, no I/O, calling nothing of the pool: reads.py (blocks served) and
catalog.py (names, shadow checks, quarantines) feed it, `kite pool stats` and /metrics read it.

Per namespace: the blocks the index holds, the blocks this replica served, the shadow checks workers
reported and how many diverged, and whether the arbitrator quarantined it. Quarantine itself is applied
by the catalog (catalog.Catalog.quarantine: its blocks are misses, then purged); this module only remembers it
and the name the fingerprint serves.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import Counter, Gauge

from kite_shared.messages import NamespaceStats

BLOCKS_SERVED = Counter("kite_pool_namespace_blocks_served_total", "Blocks served by gets, by namespace",
                        ["namespace"])
SHADOW_CHECKS = Counter("kite_pool_namespace_shadow_checks_total", "Shadow checks workers reported, by "
                        "namespace and outcome", ["namespace", "outcome"])
QUARANTINED = Gauge("kite_pool_namespace_quarantined", "1 while the namespace is quarantined (an alert: its "
                    "reused KV diverged from recomputation)", ["namespace"])


@dataclass
class _Namespace:
    name: str = ""  # "<base>" or "<base>:<adapter>"; "" until a fingerprint or shadow message names it
    num_blocks_served: int = 0
    num_shadow_checks: int = 0
    num_divergences: int = 0
    quarantined: bool = False


class NamespaceAudit:
    def __init__(self) -> None:
        self._by_tag: dict[str, _Namespace] = {}  # model tag -> its record

    def _get(self, tag: str, name: str = "") -> _Namespace:
        record = self._by_tag.setdefault(tag, _Namespace())
        record.name = name or record.name
        return record

    def _label(self, tag: str, record: _Namespace) -> str:
        return f"{record.name or '?'}/{tag}"

    def named(self, tag: str, name: str) -> None:
        self._get(tag, name)

    def served(self, tag: str, num_blocks: int) -> None:
        record = self._get(tag)
        record.num_blocks_served += num_blocks
        BLOCKS_SERVED.labels(self._label(tag, record)).inc(num_blocks)

    def shadow_checked(self, tag: str, name: str, diverged: bool) -> None:
        record = self._get(tag, name)
        record.num_shadow_checks += 1
        record.num_divergences += diverged
        SHADOW_CHECKS.labels(self._label(tag, record), "diverged" if diverged else "match").inc()

    def set_quarantined(self, tag: str, name: str, quarantined: bool) -> None:
        record = self._get(tag, name)
        record.quarantined = quarantined
        QUARANTINED.labels(self._label(tag, record)).set(int(quarantined))

    def stats(self, blocks_by_tag: dict[str, int]) -> dict[str, NamespaceStats]:
        """Every namespace seen or holding blocks, by model tag."""
        tags = set(self._by_tag) | set(blocks_by_tag)
        out = {}
        for tag in sorted(tags):
            record = self._by_tag.get(tag, _Namespace())
            out[tag] = NamespaceStats(name=record.name, blocks=blocks_by_tag.get(tag, 0),
                                      blocks_served=record.num_blocks_served,
                                      shadow_checks=record.num_shadow_checks,
                                      divergences=record.num_divergences, quarantined=record.quarantined)
        return out
