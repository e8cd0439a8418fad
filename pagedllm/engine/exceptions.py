"""The engine's errors, in a module that imports nothing of the engine (so no import cycles)."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine core process is gone (crashed, killed, or shut down)."""


class EngineOverloadedError(RuntimeError):
    """More requests waiting than --max-waiting-requests (or every data-parallel replica
    full): refused, not queued."""


class RequestFailedError(RuntimeError):
    """The engine failed a step because of these requests; they were ended, the engine goes
    on. client_error: the cause was a ValueError, the request's own fault (HTTP 400, else 500)."""

    def __init__(self, req_ids: list[str], message: str, client_error: bool = False) -> None:
        super().__init__(message)
        self.req_ids = list(req_ids)
        self.client_error = client_error

    @classmethod
    def caused_by(cls, req_ids: list[str], cause: BaseException) -> "RequestFailedError":
        names = ", ".join(repr(r) for r in req_ids)
        return cls(
            req_ids,
            f"the engine failed running request {names}: {type(cause).__name__}: {cause}",
            client_error=isinstance(cause, ValueError),
        )
