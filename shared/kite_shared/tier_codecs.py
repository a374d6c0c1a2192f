"""Which codec each tier stores a namespace's KV units in (issue 17): for example lossless in the hot
tier, where bytes are cheap and reads are most frequent, and int8 in the cold one, where a unit is paid for
by the byte for months.

Pure and torch-free (the ru-pool reads it without loading torch); a leaf: it imports nothing of KITE.
- Workers write every unit in the hot codec (KITE_KV_CODEC: a lossy codec, or "" for the storage dtype).
- Each unit then carries, under its MAC, the codec the warm tier stores it in and the one the cold tier
  does (recyclable_unit's `warm_codec` and `cold_codec`).
- The ru-pool transcodes a unit on its way down (write-through and demotion to warm, demotion and archival
  to cold) when its tier's codec is lossy and the unit is not in it yet (kite_shared.kv_codec.transcode).
  The pool needs no setting of its own for this: the signed unit says it.
- Units are only made lossier on the way down, never the other way. A lossy unit promoted to a faster tier
  stays what it is.
- So a namespace's tiers go from lossless to lossy, never back: a tier's codec is either the one of the
  tier above it or, below a lossless tier, a lossy one. Lossy to another lossy codec would compound two
  errors, and is refused.

A namespace whose policy has any lossy tier holds blocks that are not the computed ones. So its policy
enters the execution-path fingerprint (`fingerprint`) and it is a namespace of its own: its units are never
taken for exact ones. Every lossless policy fingerprints as "", so lossless roots stay what they were. A
single lossy codec for every tier fingerprints as that codec ("int8"), as before per-tier codecs existed.
"""

from __future__ import annotations

from dataclasses import dataclass

# The lossy codecs (kite_shared.kv_codec encodes and decodes them, with torch). Defined here, a leaf
# module, so that the fingerprint, the unit format and the ru-pool share the list without torch.
LOSSY_CODECS = ("int8", "fp8_e4m3")
LOSSLESS_NAME = "exact"  # how a lossless tier is written in a policy's fingerprint
TIERS = ("hot", "warm", "cold")


class TierCodecsError(ValueError):
    """A policy that is not one: an unknown codec, or a tier less lossy than the one above it."""


@dataclass(frozen=True)
class TierCodecs:
    """The lossy codec of each tier ("" = lossless, the storage dtype), each one resolved: `warm` and
    `cold` are never "" because they were left unset, only because they are lossless."""

    hot: str = ""
    warm: str = ""
    cold: str = ""

    def __post_init__(self) -> None:
        for tier in TIERS:
            codec = getattr(self, tier)
            if codec not in ("", *LOSSY_CODECS):
                raise TierCodecsError(f"the {tier} tier's codec {codec!r} is not one of "
                                      f"{', '.join(LOSSY_CODECS)} or lossless")
        for upper, lower in (("hot", "warm"), ("warm", "cold")):
            above, below = getattr(self, upper), getattr(self, lower)
            if above and below != above:
                raise TierCodecsError(
                    f"the {lower} tier cannot store {below or 'lossless'} units below a {upper} tier of "
                    f"{above}: a tier is as lossy as the one above it or, below a lossless one, lossy")

    @classmethod
    def from_settings(cls, written: str, warm: str = "", cold: str = "") -> TierCodecs:
        """From KITE_KV_CODEC (what workers write), KITE_KV_CODEC_WARM and KITE_KV_CODEC_COLD, each ""
        when unset: an unset tier stores what the tier above it does."""
        resolved_warm = warm or written
        return cls(hot=written, warm=resolved_warm, cold=cold or resolved_warm)

    @classmethod
    def from_fingerprint(cls, value: str) -> TierCodecs:
        """The policy whose `fingerprint` is `value` (what ExecutionPathFingerprint.kv_codec holds)."""
        if "," not in value:
            return cls(value, value, value)
        parts = dict(part.partition("=")[::2] for part in value.split(","))
        if sorted(parts) != sorted(TIERS):
            raise TierCodecsError(f"a tier codec policy names {', '.join(TIERS)}, got {value!r}")
        names = [parts[tier] for tier in TIERS]
        return cls(*("" if name == LOSSLESS_NAME else name for name in names))

    @property
    def fingerprint(self) -> str:
        """"" when every tier is lossless, the codec when every tier has the same lossy one, else
        "hot=exact,warm=exact,cold=int8" (the tiers in order)."""
        if self.hot == self.warm == self.cold:
            return self.hot
        return ",".join(f"{tier}={getattr(self, tier) or LOSSLESS_NAME}" for tier in TIERS)

    @property
    def lossy(self) -> tuple[str, ...]:
        """The lossy codecs some tier stores, each once, in tier order."""
        return tuple(dict.fromkeys(c for c in (self.hot, self.warm, self.cold) if c))
