"""The ru-pool's background work (kite_ru_pool.background): a stop waits for it, bounded, and what it cuts
has ended when the stop goes on."""

from __future__ import annotations

import asyncio

from kite_ru_pool.background import BackgroundTasks


def test_finish_waits_for_what_ends_in_time_and_ends_the_rest():
    ended = []

    async def quick() -> None:
        await asyncio.sleep(0.01)
        ended.append("quick")

    async def stubborn() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            pass  # swallowed, as Python 3.11's wait_for can when the cancel meets its inner future's end
        await asyncio.sleep(10)  # a cancel repeated ends it here

    async def scenario() -> None:
        background = BackgroundTasks()
        tasks = [background.spawn(quick(), "quick"), background.spawn(stubborn(), "stubborn")]
        assert await asyncio.wait_for(background.finish(timeout_s=0.2), 5.0) == 1
        assert ended == ["quick"]
        assert tasks[1].cancelled()  # ended before finish returned: nothing runs on after a stop
        assert len(background) == 0

    asyncio.run(scenario())
