"""Pure statistics of benchmark runs: percentiles, per-run summaries, peer ratios."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field


@dataclass
class RequestResult:
    """One request as the bench saw it. Times are seconds; `start` and `end` are relative to the run start."""

    request_id: str  # "<session>/<turn>"
    start: float
    end: float
    ttft: float | None  # None when no token came back
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens whose KV was reused (reported by the server, or estimated for peers)
    text: str = ""
    error: str | None = None
    retries: int = 0  # 503 answers retried before this result

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.ttft is None or self.completion_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.completion_tokens - 1)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["e2e"] = self.e2e
        d["tpot"] = self.tpot
        return d


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100), like numpy's default; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


@dataclass
class Summary:
    requests: int
    ok: int
    errors: int
    wall_s: float
    ttft_p50: float | None
    ttft_p99: float | None
    ttft_mean: float | None
    tpot_p50: float | None
    tpot_mean: float | None
    e2e_p50: float | None
    e2e_p99: float | None
    requests_per_s: float | None
    output_tokens_per_s: float | None
    total_tokens_per_s: float | None
    prompt_tokens: int
    prompt_tokens_reused: int
    prompt_tokens_computed: int
    completion_tokens: int
    hit_rate: float | None  # reused / prompt tokens
    requests_with_hit: int
    retries: int = 0
    error_messages: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(results: list[RequestResult], wall_s: float) -> Summary:
    ok = [r for r in results if r.error is None]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    tpots = [r.tpot for r in ok if r.tpot is not None]
    e2es = [r.e2e for r in ok]
    prompt = sum(r.prompt_tokens for r in ok)
    reused = sum(r.cached_tokens for r in ok)
    completion = sum(r.completion_tokens for r in ok)
    rate = (lambda x: x / wall_s) if wall_s > 0 else (lambda x: None)
    errors = [r.error for r in results if r.error is not None]
    return Summary(
        requests=len(results), ok=len(ok), errors=len(errors), wall_s=wall_s,
        ttft_p50=percentile(ttfts, 50), ttft_p99=percentile(ttfts, 99), ttft_mean=mean(ttfts),
        tpot_p50=percentile(tpots, 50), tpot_mean=mean(tpots),
        e2e_p50=percentile(e2es, 50), e2e_p99=percentile(e2es, 99),
        requests_per_s=rate(len(ok)), output_tokens_per_s=rate(completion),
        total_tokens_per_s=rate(prompt + completion),
        prompt_tokens=prompt, prompt_tokens_reused=reused, prompt_tokens_computed=prompt - reused,
        completion_tokens=completion, hit_rate=(reused / prompt) if prompt else None,
        requests_with_hit=sum(1 for r in ok if r.cached_tokens > 0),
        retries=sum(r.retries for r in results),
        error_messages=sorted(set(errors))[:5])


# Metrics compared between systems; True = lower is better.
RATIO_METRICS: dict[str, bool] = {
    "ttft_p50": True,
    "ttft_p99": True,
    "tpot_p50": True,
    "e2e_p50": True,
    "e2e_p99": True,
    "requests_per_s": False,
    "output_tokens_per_s": False,
}


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def ratios(kite: Summary, peer: Summary) -> dict[str, dict]:
    """KITE / peer for each compared metric, and whether KITE is ahead on it."""
    out = {}
    for metric, lower_better in RATIO_METRICS.items():
        r = ratio(getattr(kite, metric), getattr(peer, metric))
        ahead = None if r is None else (r < 1.0 if lower_better else r > 1.0)
        out[metric] = {"ratio": r, "kite_ahead": ahead, "lower_is_better": lower_better}
    return out


def hit_rate_timeline(results: list[RequestResult]) -> list[tuple[float, float, float]]:
    """(end time, this request's hit rate, cumulative token hit rate) in completion order."""
    points = []
    total = reused = 0
    for r in sorted((r for r in results if r.error is None), key=lambda r: r.end):
        total += r.prompt_tokens
        reused += r.cached_tokens
        points.append((r.end, r.cached_tokens / r.prompt_tokens if r.prompt_tokens else 0.0,
                       reused / total if total else 0.0))
    return points
