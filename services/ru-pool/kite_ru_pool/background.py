"""The ru-pool's background work: tier writes and maintenance that run after a handler has replied
(write-through, demotions, promotions, deletions, purges, the index rebuild).

Boundary: asyncio only; it knows nothing of the pool. The pool's parts (writes, reads, maintenance,
tier I/O's hot files, the replica layer's sends) spawn into one BackgroundTasks (core.PoolCore's), and
the service waits for it when it stops (bounded), so a drain finishes the writes it can.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable

from kite_shared.endpoints import cancel_and_wait

log = logging.getLogger(__name__)


class BackgroundTasks:
    def __init__(self) -> None:
        self.tasks: set[asyncio.Task] = set()

    def __len__(self) -> int:
        return len(self.tasks)

    def spawn(self, coro: Awaitable[object], what: str) -> asyncio.Task:
        """Run `coro` in the background; a failure is logged with its traceback, naming `what`."""
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)

        def done(t: asyncio.Task) -> None:
            self.tasks.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.error("%s failed", what, exc_info=t.exception())
        task.add_done_callback(done)
        return task

    async def drain(self) -> None:
        """Wait until nothing runs, including what the running tasks spawn meanwhile."""
        while self.tasks:
            await asyncio.gather(*list(self.tasks), return_exceptions=True)

    async def finish(self, timeout_s: float) -> int:
        """Wait up to `timeout_s` for what runs now, then cancel the rest and wait until it has ended (so
        nothing runs on against tier clients the caller closes next; a cancel that Python 3.11's wait_for
        swallowed is repeated: `cancel_and_wait`); returns how many were cut."""
        if not self.tasks:
            return 0
        _, pending = await asyncio.wait(set(self.tasks), timeout=timeout_s)
        await cancel_and_wait(list(pending))
        return len(pending)
