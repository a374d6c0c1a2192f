"""The gateway's stream inboxes (kite_gateway.generation.StreamInboxes) against a real nats-server: one
subscription carries every request's stream, another the StreamBatches; each event reaches the inbox of the
request its subject (or its place in a batch) names; events of a closed request are dropped."""

from __future__ import annotations

import asyncio

import nats

from kite_shared import subjects
from kite_shared.messages import StreamBatch
from kite_gateway.generation import StreamInboxes


async def test_one_subscription_routes_each_request_s_events_to_its_inbox(nats_server):
    gateway_nc = await nats.connect(nats_server.url)
    worker_nc = await nats.connect(nats_server.url)
    try:
        inboxes = StreamInboxes(gateway_nc, "gw_1")
        subject_a, inbox_a = await inboxes.open("a")
        subject_b, inbox_b = await inboxes.open("b")
        assert (subject_a, subject_b) == (subjects.stream("gw_1", "a"), subjects.stream("gw_1", "b"))
        assert len(gateway_nc._subs) == 2  # one SUB for every request of this gateway, one for batches
        await gateway_nc.flush()
        for subject, data in [(subject_a, b"a0"), (subject_b, b"b0"), (subject_a, b"a1"),
                              (subjects.stream("gw_2", "a"), b"another gateway's")]:
            await worker_nc.publish(subject, data)
        await worker_nc.flush()
        got_a = [await asyncio.wait_for(inbox_a.get(), 5) for _ in range(2)]
        got_b = await asyncio.wait_for(inbox_b.get(), 5)
        assert (got_a, got_b) == ([b"a0", b"a1"], b"b0")

        inboxes.close("a")
        await worker_nc.publish(subject_a, b"late")
        await worker_nc.publish(subject_b, b"b1")
        await worker_nc.flush()
        assert await asyncio.wait_for(inbox_b.get(), 5) == b"b1"
        assert inbox_a.empty()  # the closed request's event went nowhere
        _, inbox_c = await inboxes.open("c")
        assert len(gateway_nc._subs) == 2 and inbox_c.empty()

        batch = StreamBatch(request_ids=["c", "a", "b", "c"], events=[b"c0", b"a-late", b"b2", b"c1"])
        await worker_nc.publish(inboxes.batch_subject, batch.encode())
        await worker_nc.publish(inboxes.batch_subject, b"not a batch")  # logged and dropped
        await worker_nc.publish(inboxes.batch_subject, StreamBatch(request_ids=["b"], events=[b"b3"]).encode())
        await worker_nc.flush()
        assert [await asyncio.wait_for(inbox_c.get(), 5) for _ in range(2)] == [b"c0", b"c1"]
        assert [await asyncio.wait_for(inbox_b.get(), 5) for _ in range(2)] == [b"b2", b"b3"]
        assert inbox_a.empty()
    finally:
        await gateway_nc.close()
        await worker_nc.close()
