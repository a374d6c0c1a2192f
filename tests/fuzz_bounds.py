"""How long a fuzzed generation may be: schema-valid max_tokens ask for up to the whole context window, and n
up to 8, which on a CPU takes minutes per request. Fuzzing checks what the API answers, not how fast the
model generates, so values that fit the context are lowered to a few tokens, values beyond it are kept
(they must be a 400), and a body that sets neither asks for a few tokens too (the stack's default,
KITE_DEFAULT_MAX_TOKENS, may be the whole context left). Used by tests/integration/test_fuzz_api.py and, through tests/schemathesis_hooks.py,
by `schemathesis run` against a running stack (schemathesis.toml)."""

from __future__ import annotations

CLAMP_BELOW = 100_000  # max_tokens values below this are lowered (beyond the context they are a 400)
CLAMPED_MAX_TOKENS = 4


def clamp_generation_length(body: object) -> None:
    """Bound `max_tokens` / `max_completion_tokens` of a request body in place (see the module docstring)."""
    if not isinstance(body, dict):
        return
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:  # absent or null
        body["max_tokens"] = CLAMPED_MAX_TOKENS
    for field in ("max_tokens", "max_completion_tokens"):
        value = body.get(field)
        # JSON integers may come as 5000.0 (the API accepts them): lower those too.
        if isinstance(value, (int, float)) and not isinstance(value, bool) and \
                CLAMPED_MAX_TOKENS < value < CLAMP_BELOW:
            body[field] = CLAMPED_MAX_TOKENS
