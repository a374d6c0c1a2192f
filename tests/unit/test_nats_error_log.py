"""NatsErrorLog, the error callback of every KITE NATS connection: nats-py retries a refused connect every
0.5 s for ever (the first connect included), so an unchanged error is logged with backoff; a refused
credential at ERROR with a hint; never a secret."""

from __future__ import annotations

import logging

import nats.errors

from kite_shared.config import CommonConfig, load
from kite_shared.service import NatsErrorLog


def records(caplog) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "kite_shared.service.nats_connection"]


async def test_a_repeated_error_is_logged_with_backoff_and_counted(caplog):
    now = [100.0]
    errors = NatsErrorLog(None, clock=lambda: now[0])
    refused = ConnectionRefusedError(111, "Connect call failed ('127.0.0.1', 1)")
    with caplog.at_level(logging.DEBUG):
        for _ in range(9):
            await errors(refused)
            now[0] += 0.5
    logged = records(caplog)
    assert [level for level, _ in logged] == [logging.WARNING] * 4  # the 1st, 2nd, 4th and 8th
    assert logged[0][1] == f"NATS error: {refused}"
    assert [m.rsplit("(", 1)[-1] for _, m in logged[1:]] == ["2 times)", "4 times)", "8 times)"]
    assert errors.failures == 9 and errors.last == str(refused)

    caplog.clear()
    now[0] += NatsErrorLog.REPEAT_EVERY_S  # a minute on: logged again even though 10 is no power of two
    with caplog.at_level(logging.DEBUG):
        await errors(refused)
    assert records(caplog) == [(logging.WARNING, f"NATS error: {refused} (10 times)")]

    errors.connected()  # counts restart: the next outage is logged from its first error
    caplog.clear()
    with caplog.at_level(logging.DEBUG):
        await errors(refused)
    assert records(caplog) == [(logging.WARNING, f"NATS error: {refused}")] and errors.failures == 1


async def test_an_authorization_violation_is_an_error_with_a_hint_and_no_secret(caplog):
    common = load(CommonConfig, {"KITE_NATS_USER": "kite", "KITE_NATS_PASSWORD": "pw-Secret-51d0"})
    errors = NatsErrorLog(common)
    with caplog.at_level(logging.DEBUG):
        await errors(nats.errors.Error("nats: 'Authorization Violation'"))
        await errors(nats.errors.Error("nats: echoed pw-Secret-51d0"))
        await errors(nats.errors.TimeoutError())
    (level, message), (_, echoed), (_, timeout) = records(caplog)
    assert level == logging.ERROR and message.startswith("NATS error: nats: 'Authorization Violation' (")
    assert "KITE_NATS_PASSWORD" in message
    assert "pw-Secret-51d0" not in caplog.text and "***" in echoed
    assert timeout.startswith("NATS error: ") and timeout != "NATS error: "  # never an empty reason
