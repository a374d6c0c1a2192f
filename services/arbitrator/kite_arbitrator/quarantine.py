"""Quarantine of namespaces whose reused KV was caught diverging (issue 16). Pure: no NATS.

Workers shadow-verify a sample of their cache hits (kite_worker.shadow) and report every check
(ShadowCheckResult). A namespace (a model fingerprint: base or adapter, under one execution path) whose
checks diverged `divergences_to_quarantine` times (KITE_ARBITRATOR_QUARANTINE_DIVERGENCES) is quarantined:
the arbitrator publishes a `quarantine` decision, on which every ru-pool replica stops serving the
namespace's blocks and purges them, and every worker drops its local copies and reuses nothing of it. The
namespace stays quarantined until an operator clears it (`kite arbitrator clear-quarantine`): one bad
batch of blocks means its source is suspect, so nothing returns to service on its own.

Every replica counts every check (`observe`); only the leader decides (`due`), so no replica holds a
quarantine that was never published. Followers learn the leader's quarantines and lifts from the decisions
they see (`adopt`); a replica that takes over asks `due()` once, which quarantines what crossed the
threshold while no leader decided (the leader gone, or a result it missed).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from kite_shared.messages import Decision, ShadowCheckResult


@dataclass
class NamespaceRecord:
    namespace: str  # the model name the fingerprint serves
    num_checks: int = 0
    num_divergences: int = 0
    max_divergence: float = 0.0  # nats, over the checks seen
    first_divergence_at: float = 0.0  # unix seconds; 0: none yet
    quarantined_at: float = 0.0  # unix seconds; 0: not quarantined
    last_diverged: ShadowCheckResult | None = None  # the latest diverging check, named in the decision

    def forget_divergences(self) -> None:
        """Counting starts anew: an operator judged the source fixed."""
        self.num_divergences = 0
        self.first_divergence_at = self.quarantined_at = 0.0
        self.last_diverged = None


class QuarantineBook:
    def __init__(self, divergences_to_quarantine: int = 1) -> None:
        self.divergences_to_quarantine = divergences_to_quarantine
        self.records: dict[str, NamespaceRecord] = {}  # model fingerprint (hex) -> record
        self.decisions: dict[str, Decision] = {}  # model fingerprint -> its quarantine decision in force

    def observe(self, result: ShadowCheckResult) -> None:
        """Count one check (every replica, leader or not)."""
        record = self.records.setdefault(result.model_fingerprint, NamespaceRecord(result.namespace))
        record.num_checks += 1
        record.max_divergence = max(record.max_divergence, result.divergence)
        if result.diverged:
            record.num_divergences += 1
            record.first_divergence_at = record.first_divergence_at or result.checked_at
            record.last_diverged = result

    def due(self) -> list[Decision]:
        """The leader's part: a quarantine decision, now in force, for each namespace whose divergences
        reached the threshold and that is not quarantined yet. The caller publishes and stores them."""
        decisions = []
        for fingerprint, record in self.records.items():
            if fingerprint in self.decisions or record.num_divergences < self.divergences_to_quarantine:
                continue
            last = record.last_diverged
            record.quarantined_at = time.time()
            decision = self.decisions[fingerprint] = Decision(
                decision_id=uuid.uuid4().hex[:12], action="quarantine", target=fingerprint,
                namespace=record.namespace, quarantined=True, rule="shadow_verification",
                reason=f"{record.num_divergences} shadow check(s) of {record.namespace} diverged (last KL "
                       f"{last.divergence:.3g} > {last.tolerance:.3g}, worker {last.instance_id})")
            decisions.append(decision)
        return decisions

    def clear(self, model_fingerprint: str) -> list[Decision]:
        """An operator lifts a quarantine; returns the decision that says so (none if it was not in force)."""
        decision = self.decisions.pop(model_fingerprint, None)
        if decision is None:
            return []
        record = self.records.get(model_fingerprint)
        if record is not None:
            record.forget_divergences()
        return [Decision(decision_id=uuid.uuid4().hex[:12], action="quarantine", target=model_fingerprint,
                         namespace=decision.namespace, quarantined=False, rule="admin",
                         reason="quarantine cleared by an operator")]

    def adopt(self, decision: Decision) -> None:
        """A follower keeps what the leader decided, so that a takeover keeps every quarantine and does
        not bring back a lifted one (a lift resets the count, as on the leader)."""
        if decision.action != "quarantine" or decision.quarantined is None:
            return
        if decision.quarantined:
            self.decisions[decision.target] = decision
        else:
            self.decisions.pop(decision.target, None)
            record = self.records.get(decision.target)
            if record is not None:
                record.forget_divergences()

    def current(self) -> list[Decision]:
        """The quarantines in force, for the periodic refresh."""
        return list(self.decisions.values())
