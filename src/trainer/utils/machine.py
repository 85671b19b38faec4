"""The machine a run or a measurement happened on, as recorded beside it."""

from __future__ import annotations

import platform


def cpu_model() -> str | None:
    """The CPU's model name (/proc/cpuinfo on Linux, else what `platform` knows; None when nothing)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None
