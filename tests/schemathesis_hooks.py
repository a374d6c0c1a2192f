"""schemathesis hooks for `schemathesis run` against a running stack (named in schemathesis.toml): every
request it sends, in every phase, asks for a few tokens at most (tests/fuzz_bounds.py says why)."""

from __future__ import annotations

import schemathesis

from tests.fuzz_bounds import clamp_generation_length


@schemathesis.hook
def before_call(context, case, kwargs) -> None:
    clamp_generation_length(case.body)
