"""State kept in JetStream key-value buckets (real nats-server): the adapters loaded at run time and the
quarantines, written, read back and deleted; without JetStream nothing is kept and nothing fails."""

from __future__ import annotations

import nats

from kite_arbitrator.quarantine_store import QuarantineStore
from kite_cli.local_servers import start_nats
from kite_shared.adapter_store import AdapterStore, StoredAdapter
from kite_shared.messages import Decision


async def test_adapters_loaded_at_run_time_are_kept_until_unloaded(nats_server):
    nc = await nats.connect(nats_server.url)
    try:
        store = AdapterStore(nc)
        await store.save("support v2", "/srv/adapters/support")  # a name NATS keys could not hold as is
        await store.save("legal", "/srv/adapters/legal")
        assert await AdapterStore(nc).load() == [StoredAdapter("legal", "/srv/adapters/legal"),
                                                 StoredAdapter("support v2", "/srv/adapters/support")]
        await store.save("legal", "/srv/adapters/legal-2")  # loaded again from elsewhere: the latest wins
        await store.remove("support v2")
        await store.remove("never-stored")
        assert await AdapterStore(nc).load() == [StoredAdapter("legal", "/srv/adapters/legal-2")]
        await store.remove("legal")
    finally:
        await nc.close()


async def test_quarantines_are_kept_until_cleared(nats_server):
    nc = await nats.connect(nats_server.url)
    try:
        store = QuarantineStore(nc)
        decision = Decision(decision_id="q1", action="quarantine", target="ab" * 32, quarantined=True,
                            namespace="base", reason="1 divergence", rule="quarantine", issued_at=1.0)
        await store.save(decision)
        assert await QuarantineStore(nc).load() == [decision]
        await store.remove("ab" * 32)
        assert await QuarantineStore(nc).load() == []
    finally:
        await nc.close()


async def test_without_jetstream_nothing_is_kept_and_nothing_fails(caplog):
    server = start_nats(jetstream=False)
    nc = await nats.connect(server.url)
    try:
        store = AdapterStore(nc)
        await store.save("legal", "/srv/adapters/legal")
        assert await store.load() == []
        await store.remove("legal")
        assert caplog.text.count("JetStream is not enabled") == 1  # said once
    finally:
        await nc.close()
        server.stop()
