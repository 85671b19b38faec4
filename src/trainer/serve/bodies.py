"""Reading and parsing a request body, the same way for every handler.

A body is read up to its endpoint's limit and at a minimum rate (`connections.read_body`), then parsed with
the SDK's own request type, so a field the SDK would refuse is refused here in one line naming it. The
digest of the raw body is what a resend is compared by (`futures.FutureTable.once`).
"""

from __future__ import annotations

import hashlib
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from trainer.serve.connections import read_body
from trainer.serve.limits import Limits
from trainer.serve.replies import Refused


def digest(*parts: bytes | str) -> str:
    """SHA-256 over the parts, each ended by a NUL (so ("ab", "c") and ("a", "bc") differ)."""
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode() if isinstance(p, str) else p)
        h.update(b"\0")
    return h.hexdigest()


class Bodies:
    """Body reading under one server's limits and `--read-timeout-s`."""

    def __init__(self, limits: Limits, read_timeout_s: float):
        self.limits = limits
        self.read_timeout_s = read_timeout_s

    async def read(self, request: web.Request) -> bytes:
        """The body, up to the endpoint's limit and at the minimum rate (`connections.read_body`)."""
        limit, flag = self.limits.body_limit(request.path.removeprefix("/api/v1/"))
        return await read_body(request, limit, flag, self.read_timeout_s)

    async def parse(self, request: web.Request, cls: Any) -> tuple[Any, str]:
        """The request parsed with the SDK's type, and a digest of it for de-duplication."""
        raw = await self.read(request)
        try:
            return cls.model_validate_json(raw), digest(raw)
        except ValidationError as e:  # one line per field, as every other refusal
            why = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'body'}: {err['msg']}"
                            for err in e.errors()[:5])
            raise Refused(400, f"bad {cls.__name__}: {why[:300]}") from None
        except Exception as e:  # noqa: BLE001 - a malformed body is the client's fault
            raise Refused(400, f"bad {cls.__name__}: {' '.join(str(e).split())[:300]}") from None
