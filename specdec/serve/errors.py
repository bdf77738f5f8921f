"""API errors in OpenAI's format: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from specdec.serve.schemas import ErrorBody, ErrorDetail, dump

ERROR_TYPES = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    499: "client_closed_request",
    500: "server_error",
    503: "server_error",
}
"""HTTP status -> the error `type` sent with it"""

CLIENT_CLOSED_REQUEST = 499
"""status recorded for a request whose client went away before its answer (nginx's convention)"""


class APIError(Exception):
    """An error answered to the client: status, message (naming the value and the fix), param, code."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None, error_type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type or ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return dump(ErrorBody(error=ErrorDetail(message=self.message, type=self.error_type, param=self.param, code=self.code)))

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers)
