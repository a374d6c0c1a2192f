"""Errors the gateway returns, in the OpenAI error object shape, and how service error codes map to them."""

from __future__ import annotations

from dataclasses import dataclass, field

from kite_shared.messages import ErrorInfo
from kite_gateway.rate_limit import RateLimitExceeded

# code reported by a service -> (HTTP status, OpenAI error type)
_BAD_REQUEST = (400, "invalid_request_error")
_UNAVAILABLE = (503, "service_unavailable")
STATUS_BY_CODE: dict[str, tuple[int, str]] = {
    # 404 as OpenAI's API and vLLM answer an unknown model (clients key "does not exist" on it).
    "model_not_found": (404, "invalid_request_error"),
    "context_length_exceeded": _BAD_REQUEST,
    "invalid_prompt": _BAD_REQUEST,
    "invalid_messages": _BAD_REQUEST,
    "invalid_message": _BAD_REQUEST,
    "fingerprint_mismatch": (500, "server_error"),
    "model_mismatch": (500, "server_error"),
    "internal_error": (500, "server_error"),
    "no_worker": _UNAVAILABLE,
    "no_fingerprinter": _UNAVAILABLE,
    "overloaded": _UNAVAILABLE,
    "shutting_down": _UNAVAILABLE,
    "worker_timeout": _UNAVAILABLE,
    "worker_lost": _UNAVAILABLE,
    "stream_timeout": (504, "timeout_error"),
}
RETRY_AFTER_S = {"overloaded": 1, "no_worker": 1, "no_fingerprinter": 1, "shutting_down": 1,
                 "worker_timeout": 1}


@dataclass
class ApiError(Exception):
    status: int
    message: str
    type: str = "invalid_request_error"
    code: str | None = None
    param: str | None = None
    retry_after_s: int | None = None
    extra_headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def rate_limited(cls, exc: RateLimitExceeded) -> "ApiError":
        # The code is OpenAI's; OpenAI's own type field says `requests` or `tokens`, which the message says
        # here: clients key on the status and the code.
        return cls(status=429, message=str(exc), type="rate_limit_error", code="rate_limit_exceeded",
                   retry_after_s=exc.retry_after_s, extra_headers=exc.headers)

    @classmethod
    def from_info(cls, info: ErrorInfo) -> "ApiError":
        status, kind = STATUS_BY_CODE.get(info.code, (500, "server_error"))
        return cls(status=status, message=info.message, type=kind, code=info.code, param=info.param,
                   retry_after_s=RETRY_AFTER_S.get(info.code))

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        headers = dict(self.extra_headers)
        if self.retry_after_s:
            headers["Retry-After"] = str(self.retry_after_s)
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return headers
