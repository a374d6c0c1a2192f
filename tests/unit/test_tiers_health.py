"""Tier health: down on failure, one probe after an exponential backoff, up on success."""

from kite_shared.tiers.health import TierHealth


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_backoff_doubles_to_the_cap_and_allows_one_probe_at_a_time():
    clock = Clock()
    h = TierHealth("warm", initial_backoff_s=0.5, max_backoff_s=3.0, clock=clock)
    assert h.should_try() and h.should_try()  # up: everyone may try
    assert h.failure() is True  # up -> down
    assert not h.up and h.backoff_s == 0.5
    assert not h.should_try()
    clock.t += 0.5
    assert h.should_try()  # the probe
    assert not h.should_try()  # nobody else while it runs
    assert h.failure() is False
    assert h.backoff_s == 1.0
    backoffs = []
    for _ in range(4):
        clock.t += h.backoff_s
        assert h.should_try()
        h.failure()
        backoffs.append(h.backoff_s)
    assert backoffs == [2.0, 3.0, 3.0, 3.0]
    clock.t += 3.0
    assert h.should_try()
    assert h.success() is True
    assert h.up and h.backoff_s == 0.0 and h.should_try()
    assert h.failures == 6


def test_an_abandoned_probe_lets_the_next_caller_probe():
    clock = Clock()
    h = TierHealth("cold", initial_backoff_s=1.0, clock=clock)
    h.failure()
    clock.t += 1.0
    assert h.should_try()
    h.release_probe()
    assert h.should_try()


def test_down_log_lines_keep_the_client_message_but_mask_url_credentials():
    from kite_shared.tiers.base import _describe

    assert _describe(ValueError("WRONGPASS invalid username-password pair")) == \
        "WRONGPASS invalid username-password pair"
    assert _describe(OSError("Error connecting to rediss://kite:s3cret@redis:6380/0")) == \
        "Error connecting to rediss://***@redis:6380/0"
    assert _describe(TimeoutError()) == "no detail"
    assert len(_describe(ValueError("x" * 500))) == 200
