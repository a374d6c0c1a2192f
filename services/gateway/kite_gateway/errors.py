"""Errors the gateway returns, in the OpenAI error object shape, and how service error codes map to them."""

from __future__ import annotations

from dataclasses import dataclass

from kite_shared.messages import ErrorInfo

# code reported by a service -> (HTTP status, OpenAI error type)
_BAD_REQUEST = (400, "invalid_request_error")
_UNAVAILABLE = (503, "service_unavailable")
STATUS_BY_CODE: dict[str, tuple[int, str]] = {
    "model_not_found": _BAD_REQUEST,
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

    @classmethod
    def from_info(cls, info: ErrorInfo) -> "ApiError":
        status, kind = STATUS_BY_CODE.get(info.code, (500, "server_error"))
        return cls(status=status, message=info.message, type=kind, code=info.code, param=info.param,
                   retry_after_s=RETRY_AFTER_S.get(info.code))

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        headers = {"Retry-After": str(self.retry_after_s)} if self.retry_after_s else {}
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return headers
