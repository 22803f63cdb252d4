"""API errors: each carries its HTTP status and OpenAI's error object."""
from __future__ import annotations

from starlette.responses import JSONResponse

from l3worker.serving.openai.protocol import error_body


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | int | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        headers = {"www-authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def model_not_found(name: str) -> APIError:
    """vLLM's body for a model the server does not serve."""
    return APIError(404, f"The model `{name}` does not exist.", type_="NotFoundError", param="model", code=404)


def unauthorized() -> APIError:
    return APIError(401, "Incorrect or missing API key: send the server's key as 'Authorization: Bearer <key>'.",
                    code="invalid_api_key")


def too_large(limit: int) -> APIError:
    return APIError(413, f"Request body larger than the server's limit of {limit} bytes.", code="request_too_large")


def unavailable(message: str, code: str = "engine_unavailable") -> APIError:
    return APIError(503, message, type_="server_error", code=code)


def request_failed(message: str) -> APIError:
    """The engine gave up on this request alone (it was running at two consecutive chip-child
    failures); the server goes on serving."""
    return APIError(500, message, type_="server_error", code="request_failed")


def internal() -> APIError:
    return APIError(500, "Internal server error; the server's log has the details.", type_="server_error",
                    code="internal_error")
