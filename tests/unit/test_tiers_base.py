"""check_units: a batch verified a share per core gives each unit's own outcome, in order."""

from __future__ import annotations


import pytest

from kite_shared import recyclable_unit
from kite_shared.recyclable_unit import RUAuthError, RUChecksumError, RUKeyMismatchError
from kite_shared.security import ANONYMOUS_TENANT_TAG
from kite_shared.tiers import base
from kite_shared.tiers.base import check_units
from tests.helpers import unit_chain

KEY = b"k" * 32
FP = "ab" * 32
SHAPE = (2, 2, 1, 16, 4)


@pytest.mark.parametrize("num_cores", [1, 2, 3])
def test_each_outcome_is_its_own_units_in_order(monkeypatch, num_cores):
    monkeypatch.setattr(base, "_NUM_CORES", num_cores)
    blocks = unit_chain(FP, 7, key=KEY, shape=SHAPE)
    hashes = [h for h, _ in blocks]
    values: list = [data for _, data in blocks]
    values[1] = None  # not read
    damaged = bytearray(values[3])
    damaged[-1] ^= 0xFF
    values[3] = bytes(damaged)
    values[5] = blocks[6][1]  # another block's unit at this index
    values[6] = recyclable_unit.decode(blocks[6][1], key=KEY).encode(key=b"x" * 32)  # signed under another key

    outcomes = check_units(values, hashes, FP, KEY, ANONYMOUS_TENANT_TAG)

    assert len(outcomes) == 7
    assert [o.block_index for o in (outcomes[0], outcomes[2], outcomes[4])] == [0, 2, 4]
    assert outcomes[1] is None
    assert isinstance(outcomes[3], RUChecksumError)
    assert isinstance(outcomes[5], RUKeyMismatchError)
    assert isinstance(outcomes[6], RUAuthError)


def test_an_empty_batch_is_empty():
    assert check_units([], [], FP, KEY, ANONYMOUS_TENANT_TAG) == []
