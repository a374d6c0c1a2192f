"""The tests' shared helpers (tests/helpers.py): waits that say what they waited for, and chains whose
hashes are the production fingerprint code's. pool_stats runs against real pools in the integration tests
(test_pool_reuse, test_ru_pool_replicas, test_tier_faults, ...)."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from kite_shared import recyclable_unit
from kite_shared.fingerprint import hash_block
from kite_shared.security import ANONYMOUS_TENANT_TAG, tenant_tag
from tests.helpers import chain_hashes, chain_tokens, new_fp, unit_chain, wait_until, wait_until_async

KEY = b"k" * 32


def test_wait_until_returns_the_first_value_that_is_done():
    counter = itertools.count()
    assert wait_until(lambda: next(counter), 5.0, "three calls", done=lambda n: n >= 3, interval_s=0.001) == 3
    assert wait_until(lambda: "ready", 5.0, "a truthy value") == "ready"


def test_wait_until_names_what_it_awaited_and_the_last_value_on_timeout():
    values = iter(range(1000))
    with pytest.raises(AssertionError) as caught:
        wait_until(lambda: next(values), 0.05, "the counter to pass 10,000", done=lambda n: n > 10_000,
                   interval_s=0.01, context=lambda: "counter log")
    message = str(caught.value)
    assert "timed out after 0.05 s waiting for the counter to pass 10,000" in message
    last = int(message.split("last value seen: ")[1].split("\n")[0])
    assert last >= 1  # probed more than once, and the message carries the final probe's value
    assert message.endswith("\ncounter log")


def test_wait_until_probes_once_more_at_the_deadline():
    calls = []
    with pytest.raises(AssertionError, match="last value seen: False"):
        wait_until(lambda: calls.append(1) or False, 0.0, "nothing")
    assert len(calls) == 1  # a zero timeout still probes, once


def test_ignored_exceptions_are_not_yet_and_others_propagate():
    attempts = iter([ConnectionError("refused"), ConnectionError("refused"), "up"])

    def probe():
        value = next(attempts)
        if isinstance(value, Exception):
            raise value
        return value

    assert wait_until(probe, 5.0, "the service", interval_s=0.001, ignore=(ConnectionError,)) == "up"

    def always_refused():
        raise ConnectionError("refused")

    with pytest.raises(AssertionError, match=r"last value seen: ConnectionError\('refused'\)"):
        wait_until(always_refused, 0.02, "the service", interval_s=0.005, ignore=(ConnectionError,))
    with pytest.raises(ConnectionError):
        wait_until(always_refused, 5.0, "the service")  # not ignored: the first one ends the wait


def test_describe_shows_the_last_value_and_an_ignored_exception_as_it_is():
    with pytest.raises(AssertionError, match=r"last value seen: body \{'outcome': 'explore'\}"):
        wait_until(lambda: {"outcome": "explore"}, 0.0, "a hit", done=lambda v: v["outcome"] == "hit",
                   describe=lambda v: f"body {v}")

    def refused():
        raise ConnectionError("refused")

    with pytest.raises(AssertionError, match=r"last value seen: ConnectionError\('refused'\)"):
        wait_until(refused, 0.0, "the service", ignore=(ConnectionError,), describe=lambda v: v["outcome"])


async def test_wait_until_async_awaits_the_probe_and_lets_the_loop_run():
    box: list[int] = []

    async def fill() -> None:
        await asyncio.sleep(0.01)
        box.append(7)

    task = asyncio.create_task(fill())

    async def probe() -> list[int]:
        return list(box)

    assert await wait_until_async(probe, 5.0, "the box filled", interval_s=0.001) == [7]
    await task
    assert await wait_until_async(lambda: len(box), 5.0, "a plain value") == 1


async def test_wait_until_async_names_what_it_awaited_on_timeout():
    with pytest.raises(AssertionError) as caught:
        await wait_until_async(lambda: asyncio.sleep(0, result={"blocks": 2}), 0.03, "4 blocks",
                               done=lambda s: s["blocks"] == 4, interval_s=0.01, context=lambda: "pool log")
    assert str(caught.value) == ("timed out after 0.03 s waiting for 4 blocks; last value seen: {'blocks': 2}"
                                 "\npool log")


def test_chain_hashes_are_the_fingerprint_chain_of_the_root_named_by_the_fingerprint():
    fp = new_fp()
    tokens = chain_tokens(3)
    first = hash_block(bytes.fromhex(fp), tokens[:16], [("cache_salt", "acme")])
    second = hash_block(first, tokens[16:32])
    third = hash_block(second, tokens[32:48])
    assert chain_hashes(fp, 3, "acme") == [first, second, third]
    assert chain_hashes(fp, 2, "acme") == [first, second]  # a shorter chain is a prefix
    assert chain_hashes(fp, 3) != chain_hashes(fp, 3, "acme") != chain_hashes(new_fp(), 3, "acme")


def test_unit_chain_links_signed_units_block_by_block():
    fp = new_fp()
    chain = unit_chain(fp, 4, key=KEY, tenant="acme", cold_codec="int8")
    assert [h for h, _ in chain] == chain_hashes(fp, 4, "acme")
    parent = bytes.fromhex(fp)  # block 0's parent is the root, as workers store it
    for i, (block_hash, data) in enumerate(chain):
        unit = recyclable_unit.decode(data, key=KEY, expected_hash=block_hash)
        assert (unit.block_index, unit.parent_hash, unit.model_fingerprint) == (i, parent, fp)
        assert unit.tenant_tag == tenant_tag("acme") and unit.cold_codec == "int8" and unit.shape == (2, 2, 1, 16, 4)
        parent = block_hash
    with pytest.raises(recyclable_unit.RUAuthError):
        recyclable_unit.decode(chain[0][1], key=b"x" * 32)
    anonymous = unit_chain(fp, 1, key=KEY, shape=(1, 2, 1, 16, 1), payload=lambda i: bytes(64))
    unit = recyclable_unit.decode(anonymous[0][1], key=KEY)
    assert unit.tenant_tag == ANONYMOUS_TENANT_TAG and bytes(unit.payload) == bytes(64)
