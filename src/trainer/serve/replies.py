"""Replies shared by the protocol handlers (`models.py`, `training.py`, `sampling.py`, `app.py`) and the
management surface (`rest.py`, `downloads.py`, `checkpoints.py`).

An error is raised as `Refused` anywhere below a handler and answered by the server's middleware in the
SDK's error shape, so every 4xx of the server, whichever module refused the request, looks the same.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web


class Refused(Exception):
    """A request answered with a 4xx before any work: status, and a message for the SDK's `detail`."""

    def __init__(self, status: int, detail: str):
        super().__init__(detail)
        self.status = status
        self.detail = detail


def error_response(status: int, detail: str) -> web.Response:
    """The SDK's error shape (`{"detail": ...}`); a 4xx is marked not to be retried (the SDK obeys
    `x-should-retry`, `_base_client.py::_should_retry`, and would otherwise retry a 409), except 429:
    a key over its in-flight bound is asked to come back, which the SDK does with backoff."""
    headers = {"x-should-retry": "false"} if 400 <= status < 500 and status != 429 else None
    return web.json_response({"detail": detail}, status=status, headers=headers)


def json_result(model: Any) -> tuple[bytes, str]:
    """A future's result as the SDK reads it: the response type's JSON without its unset fields."""
    return model.model_dump_json(exclude_none=True).encode(), "application/json"
