"""Shared result types of the preflight gates: `Check` rows and the `GateReport`.

A gate returns a `GateReport`; `write(dir)` stores `<dir>/preflight/<gate>.json`
atomically (temp file + fsync + os.replace) and `print_table()` shows one row per check.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

STATUSES: tuple[str, ...] = ("pass", "fail", "unverified")


def _jsonable(x: Any) -> Any:
    """JSON-safe copy: non-finite floats become strings ("inf", "-inf", "nan")."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


@dataclass
class Check:
    """One verified quantity: its measured `value`, the `bound` it must meet and the verdict."""

    name: str
    value: Any
    bound: Any
    status: str
    detail: str = ""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(
                f"Check {self.name!r}: status must be one of {list(STATUSES)}, got {self.status!r}"
            )


@dataclass
class GateReport:
    """Result of one preflight gate.

    `passed` is true when there is at least one check, none failed and, with
    `require_verified=True`, none is "unverified".
    """

    gate: str
    checks: list[Check] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    require_verified: bool = False

    @property
    def passed(self) -> bool:
        if not self.checks:
            return False
        statuses = {c.status for c in self.checks}
        if "fail" in statuses:
            return False
        return not (self.require_verified and "unverified" in statuses)

    def counts(self) -> dict[str, int]:
        return {s: sum(c.status == s for c in self.checks) for s in STATUSES}

    def to_dict(self) -> dict[str, Any]:
        return _jsonable(
            {
                "gate": self.gate,
                "passed": self.passed,
                "counts": self.counts(),
                "require_verified": self.require_verified,
                "meta": self.meta,
                "checks": [asdict(c) for c in self.checks],
            }
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False)

    def write(self, out_dir: Path | str) -> Path:
        """Write `<out_dir>/preflight/<gate>.json` atomically; returns the path."""
        target_dir = Path(out_dir) / "preflight"
        target_dir.mkdir(parents=True, exist_ok=True)
        target = target_dir / f"{self.gate}.json"
        fd, tmp = tempfile.mkstemp(prefix=f".{self.gate}.", suffix=".tmp", dir=target_dir)
        try:
            os.chmod(tmp, 0o644)  # mkstemp creates 0600; the report is meant to be shared
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(self.to_json() + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        return target

    def print_table(self, file: TextIO | None = None) -> None:
        """Print one row per check (name, status, value, bound, detail) and a summary line."""
        out = file if file is not None else sys.stdout
        rows = [(c.name, c.status.upper(), _fmt(c.value), _fmt(c.bound), c.detail) for c in self.checks]
        header = ("check", "status", "value", "bound", "detail")
        widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
        widths[-1] = len(header[-1])  # detail is free text, not padded
        line = "  ".join(h.ljust(w) for h, w in zip(header, widths))
        print(f"== preflight gate: {self.gate} ==", file=out)
        print(line, file=out)
        print("-" * len(line), file=out)
        for r in rows:
            print("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip(), file=out)
        counts = self.counts()
        verdict = "PASSED" if self.passed else "FAILED"
        print(
            f"{verdict}: {counts['pass']} pass, {counts['fail']} fail, {counts['unverified']} unverified",
            file=out,
        )


def _fmt(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)
