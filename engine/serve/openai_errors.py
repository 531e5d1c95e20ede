"""OpenAI's error shape, shared by the /v1 modules: {"error": {"message", "type", "param", "code"}}."""
from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """A refusal in OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
             413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error"}

    MAX_MESSAGE = 2000        # a message quotes what it refuses: a megabyte-long value is cut, not echoed

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after: float | None = None):
        # what a client sent may hold text that is not valid Unicode (a lone surrogate): escaped, so the
        # error body can always be written as UTF-8
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        if len(message) > self.MAX_MESSAGE:
            message = message[:self.MAX_MESSAGE - 3] + "..."
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


def invalid(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, f"Invalid '{param}': {message}", param, code)
