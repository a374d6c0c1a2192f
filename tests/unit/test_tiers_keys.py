"""Key scheme of the warm and cold tiers."""

from kite_shared.security import ANONYMOUS_TENANT_TAG, tenant_tag
from kite_shared.tiers.keys import (
    BlockKey, model_tag, object_key, parse_object_key, parse_redis_key, redis_key, redis_pattern,
)

FP = "ab" * 32
H = bytes(range(32))
ACME = tenant_tag("acme")


def test_redis_key_layout_has_no_hash_tag_and_round_trips():
    key = BlockKey.of(FP, H, ACME)
    name = redis_key(key)
    assert name == f"kite:ru:v2:{'ab' * 8}:{ACME}:{H.hex()}"
    assert "{" not in name and "}" not in name  # no hash tags: keys spread over cluster slots
    assert parse_redis_key(name) == key
    assert parse_redis_key(name.encode()) == key
    assert redis_pattern() == "kite:ru:v2:*"
    assert redis_pattern("ab" * 8) == f"kite:ru:v2:{'ab' * 8}:*"


def test_object_key_layout_round_trips_under_a_prefix():
    key = BlockKey.of(FP, H, ACME)
    name = object_key("team/kite/", key)
    assert name == f"team/kite/ru/v2/{'ab' * 8}/{ACME}/{H.hex()}.kru"
    assert parse_object_key("team/kite/", name) == key
    assert parse_object_key("other/", name) is None


def test_the_tenant_is_part_of_the_storage_key_and_defaults_to_anonymous():
    assert BlockKey.of(FP, H).tenant_tag == ANONYMOUS_TENANT_TAG == tenant_tag("anonymous")
    assert redis_key(BlockKey.of(FP, H)) != redis_key(BlockKey.of(FP, H, ACME))
    assert len(ACME) == 16 and ACME != tenant_tag("acme2") and ACME == tenant_tag("acme")


def test_foreign_names_are_not_keys():
    assert parse_redis_key("kite:ru:v2:short:" + ACME + ":" + H.hex()) is None
    assert parse_redis_key("kite:ru:v2:" + "ab" * 8 + ":" + ACME + ":" + "zz" * 32) is None
    assert parse_redis_key("kite:ru:v2:" + "ab" * 8 + ":" + H.hex()) is None  # no tenant
    assert parse_redis_key("kite:ru:v1:" + "ab" * 8 + ":" + H.hex()) is None  # the old scheme
    assert parse_redis_key("kite:ru:v2:" + "ab" * 8 + ":" + ACME.upper() + ":" + H.hex()) is None
    assert parse_redis_key("something:else") is None
    assert parse_object_key("kite/", "kite/ru/v2/" + "ab" * 8 + "/" + ACME + "/" + H.hex() + ".tmp") is None
    assert parse_object_key("kite/", "kite/ru/v2/" + "ab" * 8 + "/" + H.hex() + ".kru") is None


def test_model_tag_keeps_hex_prefixes_and_hashes_anything_else():
    assert model_tag(FP) == "ab" * 8
    assert model_tag(FP.upper()) == "ab" * 8
    tag = model_tag("m1:../weird name")
    assert len(tag) == 16 and all(c in "0123456789abcdef" for c in tag)
    assert tag != model_tag("m2")
