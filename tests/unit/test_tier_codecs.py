"""Tier codec policies (kite_shared.tier_codecs): unset tiers inherit, tiers only get lossier on the way
down, and the fingerprint form is unambiguous and keeps the roots that existed before per-tier codecs."""

from __future__ import annotations

import pytest

from kite_shared.tier_codecs import TierCodecs, TierCodecsError


def test_an_unset_tier_stores_what_the_tier_above_it_stores():
    assert TierCodecs.from_settings("") == TierCodecs("", "", "")
    assert TierCodecs.from_settings("int8") == TierCodecs("int8", "int8", "int8")
    assert TierCodecs.from_settings("", cold="int8") == TierCodecs("", "", "int8")
    assert TierCodecs.from_settings("", warm="fp8_e4m3") == TierCodecs("", "fp8_e4m3", "fp8_e4m3")


@pytest.mark.parametrize("written, warm, cold, says", [
    ("int8", "", "fp8_e4m3", "cold tier cannot store fp8_e4m3 units below a warm tier of int8"),
    ("int8", "fp8_e4m3", "", "warm tier cannot store fp8_e4m3 units below a hot tier of int8"),
    ("", "zstd", "", "warm tier's codec 'zstd'"),
])
def test_a_tier_never_gets_less_lossy_nor_changes_lossy_codec(written, warm, cold, says):
    with pytest.raises(TierCodecsError, match=says):
        TierCodecs.from_settings(written, warm, cold)


def test_the_fingerprint_form_keeps_old_roots_and_round_trips():
    assert TierCodecs().fingerprint == ""  # every lossless root is what it was
    assert TierCodecs.from_settings("int8").fingerprint == "int8"  # as KITE_KV_CODEC=int8 was
    mixed = TierCodecs.from_settings("", cold="int8")
    assert mixed.fingerprint == "hot=exact,warm=exact,cold=int8"
    assert TierCodecs.from_settings("", warm="int8").fingerprint == "hot=exact,warm=int8,cold=int8"
    for policy in (TierCodecs(), TierCodecs.from_settings("fp8_e4m3"), mixed,
                   TierCodecs.from_settings("", warm="fp8_e4m3")):
        assert TierCodecs.from_fingerprint(policy.fingerprint) == policy
    with pytest.raises(TierCodecsError):
        TierCodecs.from_fingerprint("hot=exact,cold=int8")


def test_lossy_lists_each_lossy_codec_once():
    assert TierCodecs().lossy == ()
    assert TierCodecs.from_settings("int8").lossy == ("int8",)
    assert TierCodecs.from_settings("", cold="fp8_e4m3").lossy == ("fp8_e4m3",)
