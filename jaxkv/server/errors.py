"""HTTP errors in OpenAI's shape, and the one table from jaxkv's typed errors to them.

Every error response of the server is ``{"error": {"message", "type", "param",
"code"}}`` with the status below; nothing a client sends produces a 500 (a 500
means a bug, and says so).

| status | type                    | code                      | when                                               |
|-------:|-------------------------|---------------------------|----------------------------------------------------|
| 400    | invalid_request_error   | invalid_json              | the body is not JSON                               |
| 400    | invalid_request_error   | invalid_value / missing_* | a field has the wrong type or value; ``n`` > 1     |
| 400    | invalid_request_error   | unsupported_parameter     | a field jaxkv does not honour (logprobs, ...)      |
| 400    | invalid_request_error   | context_length_exceeded   | prompt + ``max_tokens`` exceed the context         |
| 400    | invalid_request_error   | kv_capacity_exceeded      | the turn needs more KV slots than the whole pool   |
| 400    | invalid_request_error   | option_not_allowed        | an ``extra_body`` option the server does not allow |
| 400    | invalid_request_error   | invalid_value             | options a session's stages refuse together         |
| 400    | invalid_request_error   | session_options_mismatch  | options differ from the ones the session runs with |
| 401    | authentication_error    | invalid_api_key           | missing or wrong ``Authorization: Bearer`` key     |
| 404    | not_found_error         | model_not_found / ...     | unknown model or path                              |
| 409    | conflict_error          | session_busy              | too many requests wait on one session              |
| 429    | rate_limit_error        | queue_full                | the scheduler's queue is full (``Retry-After``)    |
| 503    | server_error            | kv_pool_exhausted / ...   | the pool ran out under load, or shutting down      |
"""

from __future__ import annotations

import dataclasses

from jaxkv.errors import (
    CapacityError,
    ChatError,
    ConfigError,
    ContextLengthError,
    OutOfSlotsError,
    QueueFullError,
    SessionBusyError,
    TurnCancelledError,
)
from jaxkv.sampling import SamplingError


@dataclasses.dataclass
class APIError(Exception):
    """An error the server answers with (module docstring)."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict = dataclasses.field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.status} {self.type}/{self.code}: {self.message}"

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def from_exception(err: BaseException, *, retry_after: int = 1) -> APIError:
    """The ``APIError`` of an exception a turn raised (``CapacityError`` is checked
    before ``OutOfSlotsError``, its base)."""
    if isinstance(err, APIError):
        return err
    retry = {"Retry-After": str(int(retry_after))}
    if isinstance(err, ContextLengthError):
        return APIError(400, str(err), param="messages", code="context_length_exceeded")
    if isinstance(err, CapacityError):
        return APIError(400, str(err), param="messages", code="kv_capacity_exceeded")
    if isinstance(err, QueueFullError):
        return APIError(429, f"the server is busy: {err}; retry later", "rate_limit_error", code="queue_full", headers=retry)
    if isinstance(err, SessionBusyError):
        return APIError(409, str(err), "conflict_error", param="session_id", code="session_busy", headers=retry)
    if isinstance(err, ChatError):
        return APIError(400, str(err), param="messages", code="invalid_value")
    if isinstance(err, (ConfigError, SamplingError)):  # session options (ConfigError, OptionError), sampling values
        return APIError(400, str(err), code="invalid_value")
    if isinstance(err, OutOfSlotsError):
        return APIError(503, f"the KV pool ran out under load: {err}; retry later", "server_error", code="kv_pool_exhausted", headers=retry)
    if isinstance(err, TurnCancelledError):
        return APIError(503, "the turn was cancelled (the server is shutting down)", "server_error", code="turn_cancelled")
    return APIError(500, f"internal error: {type(err).__name__}: {err}", "server_error", code="internal_error")
