"""OpenAI-style errors: one exception type, answered as ``{"error": {"message", "type",
"param", "code"}}`` by every server here (the gateway and the emulator)."""

from __future__ import annotations

import json
from typing import Any

_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
          413: "invalid_request_error", 422: "invalid_request_error", 500: "server_error",
          502: "upstream_error", 503: "service_unavailable", 504: "upstream_timeout"}


class ApiError(Exception):
    """An error answered to the client as ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type_: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or _TYPES.get(status, "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def encode(self) -> bytes:
        return json.dumps(self.body()).encode()


def error_body(status: int, message: str, **kw: Any) -> bytes:
    return ApiError(status, message, **kw).encode()
