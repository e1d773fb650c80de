"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""
from __future__ import annotations

import re

from fastapi.responses import JSONResponse

_FIELD_NAME = re.compile(r"[a-z_][a-z0-9_]*")
# Names pydantic gives union branches in an error location ("prompt.str", "stop.list[str]").
_TYPE_TAGS = {"str", "int", "float", "bool", "none", "dict", "list"}


class ApiError(Exception):
    """A request the server refuses; becomes an OpenAI error body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def validation_error(errors: list[dict]) -> ApiError:
    """A 400 from pydantic / FastAPI validation errors, naming the offending field(s)."""
    by_param: dict[str, list[str]] = {}
    for err in errors:
        if err.get("type") == "json_invalid":
            detail = (err.get("ctx") or {}).get("error", err.get("msg", ""))
            return ApiError(400, f"malformed JSON body: {detail}", code="invalid_json")
        loc = tuple(err.get("loc", ()))
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        if err.get("type") == "extra_forbidden" and loc:  # the last item is the client's name
            param = _join(_param(loc[:-1]), loc[-1])
            msg = "unknown field"
        else:
            param = _param(loc)
        if not param and err.get("type") == "model_attributes_type":
            msg = "the request body must be a JSON object (sent as Content-Type: application/json)"
        if msg not in by_param.setdefault(param, []):
            by_param[param].append(msg)
    parts = [f"{p or 'body'}: {'; or '.join(msgs)}" for p, msgs in by_param.items()]
    first = next(iter(by_param), None) or None
    return ApiError(400, "invalid request: " + " | ".join(parts), param=first,
                    code="invalid_value")


def _param(loc) -> str:
    """('body', 'messages', 0, 'content', 'str') -> 'messages[0].content' (our field names are
    snake_case; anything else in a location names a union branch)."""
    out = ""
    for i, part in enumerate(loc):
        if i == 0 and part == "body":
            continue
        if isinstance(part, int) or (_FIELD_NAME.fullmatch(part) and part not in _TYPE_TAGS):
            out = _join(out, part)
    return out


def _join(path: str, part: str | int) -> str:
    if isinstance(part, int):
        return f"{path}[{part}]"
    return f"{path}.{part}" if path else part
