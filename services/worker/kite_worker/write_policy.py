"""Which newly computed blocks go to the ru-pool: the Upcycle write policy (issue 5), a pure core.

write_through  every new block;
selective      only blocks seen in two requests' prompts: a block computed once is held back and handed over
               when a second request asks for it;
off            nothing.

Set by KITE_WORKER_WRITE_POLICY, then by the arbitrator's `write_policy` decisions (kite_worker.control).
The reference engine filters its new blocks (`filter`, `seen`); vLLM's connector saves as many leading
blocks as `num_leading_to_write` says. Boundary: block hashes and blocks in, blocks out; no NATS, no
engine. Thread-safe: `filter` runs on the engine thread, `seen` and `set_policy` on the asyncio thread.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Protocol, TypeVar

from kite_shared.fingerprint import BlockHash
from kite_shared.messages import WRITE_POLICIES


class Block(Protocol):
    """A newly computed block, as the policy sees it (the reference engine's NewBlock)."""

    block_hash: BlockHash


B = TypeVar("B", bound=Block)

_SEEN_BLOCKS = 65536  # block hashes remembered for the selective policy
_HELD_BLOCKS = 4096  # computed-once blocks held back (they share tensors with the local cache)


class WritePolicyFilter:
    """Which newly computed blocks go to the ru-pool (see the module docstring)."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._lock = threading.Lock()
        self._seen: OrderedDict[bytes, int] = OrderedDict()  # block hash -> requests whose prompt had it
        self._held: OrderedDict[bytes, Block] = OrderedDict()

    def set_policy(self, policy: str) -> None:
        if policy not in WRITE_POLICIES:
            raise ValueError(f"unknown write policy {policy!r}")
        with self._lock:
            self.policy = policy
            if policy != "selective":
                self._held.clear()

    def seen(self, block_hashes: list[bytes]) -> list[Block]:
        """A request's prompt blocks; returns held-back blocks that are now seen twice (to write)."""
        release = []
        with self._lock:
            for h in block_hashes:
                n = self._seen.pop(h, 0) + 1
                self._seen[h] = n
                if n >= 2 and h in self._held:
                    release.append(self._held.pop(h))
            while len(self._seen) > _SEEN_BLOCKS:
                self._seen.popitem(last=False)
        return release if self.policy == "selective" else []

    def num_leading_to_write(self, block_hashes: list[bytes]) -> int:
        """For engines that save blocks themselves (vLLM's connector): how many of a prompt's leading
        blocks the policy lets through; -1 for all (and the generated ones)."""
        with self._lock:
            if self.policy == "write_through":
                return -1
            if self.policy == "off":
                return 0
            count = 0
            for h in block_hashes:
                if self._seen.get(h, 0) < 2:
                    break
                count += 1
            return count

    def filter(self, blocks: list[B]) -> list[B]:
        with self._lock:
            if self.policy == "write_through":
                return blocks
            if self.policy == "off":
                return []
            out = []
            for b in blocks:
                h = bytes(b.block_hash)
                if self._seen.get(h, 0) >= 2:
                    out.append(b)
                else:
                    self._held[h] = b
                    while len(self._held) > _HELD_BLOCKS:
                        self._held.popitem(last=False)
            return out
