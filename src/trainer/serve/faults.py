"""Faults the server can inject, to rehearse the real service's failure modes over the wire.

Spec (`--faults`, space-separated `key=value`):
- `rate=P`: share of the eligible calls that fail, each drawing one of `kinds` it can take (seeded).
- `kinds=K1,K2,...`: `500 429 408 410 failed_server failed_user drop delay poison` (default: all).
- `calls=E1,E2,...`: endpoints eligible for random faults (default: every endpoint of `ELIGIBLE`).
- `at=E#N:K,...`: the N-th call (1-based) of endpoint E gets fault K, whatever the rate.
- `seed=S`: seed of the draws; `delay_s=T`: how long `delay` holds a reply (default 50 s, past the
  SDK's 45 s read timeout of `retrieve_future`).

What each kind does, and how the pinned SDK (tinker 0.38) reacts:
- `500` / `429` / `408`: that status, before the request is handled. On a POST the SDK resends it
  (`execute_with_retries`); on `retrieve_future` it polls again.
- `410` (retrieve_future only): "promise expired"; the SDK raises `RetryableException`.
- `failed_server` / `failed_user` (retrieve_future only): the future is answered as failed with that
  category, although the work ran; the SDK raises `RequestFailedError`.
- `drop`: the request is handled, then the connection is closed without a reply; the SDK resends a
  POST (the server answers a resend of the same `seq_id` with the same future) or re-polls.
- `delay`: the reply is held `delay_s` seconds, past the client's timeout.
- `poison` (training endpoints): the model is lost; this and every later request on it fail
  (`failed_server`), as when the service drops a training run. The client must start over from a
  checkpoint.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field

KINDS = ("500", "429", "408", "410", "failed_server", "failed_user", "drop", "delay", "poison")
TRAINING = ("forward_backward", "optim_step", "save_weights", "save_weights_for_sampler")
ELIGIBLE = TRAINING + ("asample", "create_model", "load_weights", "create_sampling_session", "retrieve_future")
_RETRIEVE_ONLY = ("410", "failed_server", "failed_user")


def applicable(kind: str, endpoint: str) -> bool:
    if kind in _RETRIEVE_ONLY:
        return endpoint == "retrieve_future"
    if kind == "poison":
        return endpoint in TRAINING
    return True


@dataclass
class FaultPlan:
    rate: float = 0.0
    kinds: tuple[str, ...] = KINDS
    calls: tuple[str, ...] = ELIGIBLE
    at: dict[tuple[str, int], str] = field(default_factory=dict)
    seed: int = 0
    delay_s: float = 50.0
    injected: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()

    @classmethod
    def parse(cls, spec: str | None) -> FaultPlan:
        plan: dict = {}
        for item in (spec or "").split():
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"--faults: {item!r} is not key=value")
            if key == "rate":
                plan["rate"] = float(value)
                if not 0.0 <= plan["rate"] < 1.0:
                    raise ValueError(f"--faults: rate must be in [0, 1), got {value}")
            elif key == "kinds":
                plan["kinds"] = tuple(v for v in value.split(",") if v)
                bad = [k for k in plan["kinds"] if k not in KINDS]
                if bad:
                    raise ValueError(f"--faults: unknown kinds {bad}; known: {', '.join(KINDS)}")
            elif key == "calls":
                plan["calls"] = tuple(v for v in value.split(",") if v)
                bad = [c for c in plan["calls"] if c not in ELIGIBLE]
                if bad:
                    raise ValueError(f"--faults: unknown endpoints {bad}; known: {', '.join(ELIGIBLE)}")
            elif key == "at":
                at = {}
                for rule in value.split(","):
                    call, _, kind = rule.partition(":")
                    endpoint, _, n = call.partition("#")
                    if endpoint not in ELIGIBLE or kind not in KINDS or not n.isdigit() or int(n) < 1:
                        raise ValueError(f"--faults: at rule {rule!r} is not ENDPOINT#N:KIND")
                    if not applicable(kind, endpoint):
                        raise ValueError(f"--faults: {kind} cannot be injected on {endpoint}")
                    at[(endpoint, int(n))] = kind
                plan["at"] = at
            elif key == "seed":
                plan["seed"] = int(value)
            elif key == "delay_s":
                plan["delay_s"] = float(value)
            else:
                raise ValueError(f"--faults: unknown key {key!r} (rate, kinds, calls, at, seed, delay_s)")
        return cls(**plan)

    @property
    def active(self) -> bool:
        return self.rate > 0 or bool(self.at)

    def draw(self, endpoint: str) -> str | None:
        """The fault this call of `endpoint` gets, if any (calls are counted per endpoint)."""
        if endpoint not in ELIGIBLE:
            return None
        with self._lock:
            n = self._counts[endpoint] = self._counts.get(endpoint, 0) + 1
            kind = self.at.get((endpoint, n))
            if kind is None and self.rate > 0 and endpoint in self.calls and self._rng.random() < self.rate:
                options = [k for k in self.kinds if applicable(k, endpoint)]
                kind = self._rng.choice(options) if options else None
            if kind is not None:
                self.injected[kind] = self.injected.get(kind, 0) + 1
            return kind
