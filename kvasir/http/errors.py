"""OpenAI-shaped errors: each bridge error code, and the front's own refusals, as an HTTP
status, a body ``{"error": {"message", "type", "param", "code"}}`` and its headers."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from kvasir.errors import KvasirError
from kvasir.http.schema import ErrorBody, ErrorDetail

UNKNOWN = "Object contains unknown field `"
RETRY_AFTER_S = 5  # what a 503 asks the client to wait

# bridge error code -> (HTTP status, OpenAI error type)
STATUS: dict[str, tuple[int, str]] = {
    "invalid_request": (400, "invalid_request_error"),
    "too_long": (400, "invalid_request_error"),
    "unknown_request": (400, "invalid_request_error"),
    "invalid_api_key": (401, "authentication_error"),
    "not_found": (404, "invalid_request_error"),
    "model_not_found": (404, "invalid_request_error"),
    "overloaded": (429, "rate_limit_error"),
    "shutting_down": (503, "service_unavailable"),
    "restarting": (503, "service_unavailable"),
    "starting": (503, "service_unavailable"),
    "unavailable": (503, "service_unavailable"),
    "method_not_allowed": (405, "invalid_request_error"),
    "request_too_large": (413, "invalid_request_error"),
    "request_timeout": (408, "invalid_request_error"),
    "unsupported_media_type": (415, "invalid_request_error"),
    "stage_failed": (500, "server_error"),
    "internal_error": (500, "server_error"),
}


@dataclass
class ApiError(KvasirError):
    """A refusal or failure, as the HTTP client will see it."""

    code: str
    message: str
    param: str | None = None

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"

    @property
    def status(self) -> int:
        return STATUS.get(self.code, (500, "server_error"))[0]

    @property
    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(RETRY_AFTER_S)} if self.status == 503 else {}

    def body(self) -> bytes:
        kind = STATUS.get(self.code, (500, "server_error"))[1]
        return msgspec.json.encode(ErrorBody(ErrorDetail(self.message, kind, self.param, self.code)))


def invalid(message: str, param: str | None = None) -> ApiError:
    return ApiError("invalid_request", message, param)


def from_validation(exc: msgspec.ValidationError | msgspec.DecodeError) -> ApiError:
    """A body that does not decode: msgspec's "... - at `$.max_tokens`" names the field."""
    if isinstance(exc, msgspec.DecodeError) and not isinstance(exc, msgspec.ValidationError):
        return invalid(f"the body is not valid JSON: {exc}")
    text, sep, where = str(exc).rpartition(" - at `")
    if not sep:
        text, where = str(exc), ""
    at = where.rstrip("`").removeprefix("$").lstrip(".").replace("[...]", "")  # a map's value: the map
    if text.startswith(UNKNOWN) and text.endswith("`"):  # msgspec's "Object contains unknown field `name`"
        unknown = text[len(UNKNOWN) : -1]
        param = f"{at}.{unknown}" if at else unknown
        return invalid(f"{param}: this server knows no such field, and refuses what it would not honour", param)
    return invalid(f"{at}: {text}" if at else text, at or None)
