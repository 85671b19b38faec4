"""How many sampling sessions the server holds: per session (`--max-samplers-per-session`) and in all
(`--max-samplers`).

A sampler is cheap while it samples the base model (it shares the base weights), but a snapshot of a
training client (`save_weights_for_sampler` without a path) copies the adapter (~87 MB at rank 64 on
SmolLM2, in float32) and may build merged sampler weights, so a session that keeps making them would fill
the machine. An RL loop makes one per step and samples only the newest (tinker-cookbook's `rl/train.py`,
this project's `trainer/loop.py`), so a session at its cap retires its least recently used sampler that
has no request in flight to make room; a retired id then answers 404 naming the flag. Only when every
sampler of the session is busy is a new one refused (413 naming the flag). The server-wide cap refuses
past it. A sampler id is reserved when its creation is accepted (a creation still running holds its
place, so concurrent requests cannot pass a cap together) and freed with its session; the server then
drops the sampler objects, the engine drops their merged weights, and the pages go back to the OS
(`LocalServiceClient.release_memory`). Samplers of one checkpoint share one snapshot, so they cost one
adapter copy together (`LocalServiceClient.create_sampling_client`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from trainer.serve.limits import LimitExceeded, Limits

# said with every server-wide refusal when the server runs without --api-key
KEYLESS_NOTE = ("without --api-key every 'tml-' key on this machine draws on this one server-wide budget; "
                "start the server with --api-key-file (one key per user) to give each user the per-key "
                "limits")
MAX_RETIRED = 4096  # retired ids remembered for their 404's reason (beyond: the plain unknown-id 404)


def session_of(ident: str) -> str:
    """The session an id was created under (`s-<hex>:sample:N`)."""
    return ident.split(":")[0]


class SamplerSlots:
    """Sampler ids reserved per session (created, or being created), in order of last use, and how many
    requests each has in flight. Every method runs under the server's lock."""

    def __init__(self, limits: Limits, lock: threading.RLock, keyless: bool):
        self.limits = limits
        self.lock = lock
        self.keyless = keyless
        self.by_session: dict[str, OrderedDict[str, None]] = {}
        self.busy: dict[str, int] = {}
        self.retired: OrderedDict[str, None] = OrderedDict()

    def total(self) -> int:
        with self.lock:
            return sum(len(v) for v in self.by_session.values())

    def reserve(self, sampler_id: str) -> str | None:
        """Hold a place for `sampler_id`; returns the id of a sampler of the same session to retire for it
        (the caller drops that sampler), or None. LimitExceeded naming the flag of the cap it would pass
        when every sampler of the session is busy, or the server holds `--max-samplers`. A sampler already
        reserved keeps its place (a resend takes no second one)."""
        session = session_of(sampler_id)
        with self.lock:
            mine = self.by_session.get(session, OrderedDict())
            if sampler_id in mine:
                return None
            retire = None
            if len(mine) >= self.limits.samplers_per_session:
                retire = next((s for s in mine if not self.busy.get(s)), None)
                if retire is None:
                    raise LimitExceeded(
                        f"this session already has {len(mine)} samplers, each with requests in flight, this "
                        f"server's limit ({Limits.flag('samplers_per_session')}); wait for some to finish "
                        "(an idle sampler gives its place to a new one) or end the session")
            else:
                total = self.total()
                if total >= self.limits.samplers:
                    note = f"; {KEYLESS_NOTE}" if self.keyless else ""
                    raise LimitExceeded(f"this server already holds {total} samplers, its limit "
                                        f"({Limits.flag('samplers')}); a sampler is freed when its session "
                                        f"ends{note}")
            if retire is not None:
                self.free(retire)
                self.retired[retire] = None
                while len(self.retired) > MAX_RETIRED:
                    self.retired.popitem(last=False)
            self.by_session.setdefault(session, OrderedDict())[sampler_id] = None
            return retire

    def used(self, sampler_id: str) -> None:
        """The sampler was just used: it is the session's last to be retired."""
        with self.lock:
            mine = self.by_session.get(session_of(sampler_id))
            if mine is not None and sampler_id in mine:
                mine.move_to_end(sampler_id)

    def started(self, sampler_id: str) -> None:
        with self.lock:
            self.busy[sampler_id] = self.busy.get(sampler_id, 0) + 1

    def finished(self, sampler_id: str) -> None:
        with self.lock:
            n = self.busy.get(sampler_id, 0) - 1
            if n > 0:
                self.busy[sampler_id] = n
            else:
                self.busy.pop(sampler_id, None)

    def was_retired(self, sampler_id: str) -> str | None:
        """The 404 detail for a sampler retired to make room, or None."""
        if sampler_id not in self.retired:
            return None
        return (f"sampler {sampler_id[:100]} was retired: its session made more than "
                f"{self.limits.samplers_per_session} samplers ({Limits.flag('samplers_per_session')}), "
                "and the least recently used idle one gave its place to a new one; create a sampler again")

    def free(self, sampler_id: str) -> None:
        """Give back one sampler's place."""
        with self.lock:
            session = session_of(sampler_id)
            mine = self.by_session.get(session)
            if mine is not None:
                mine.pop(sampler_id, None)
                if not mine:
                    del self.by_session[session]

    def end_session(self, session: str) -> None:
        """Every place of an ended session."""
        with self.lock:
            for sid in self.by_session.pop(session, ()):
                self.busy.pop(sid, None)
