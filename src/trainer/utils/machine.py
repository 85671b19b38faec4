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


def cpu_flags_line() -> str:
    """The CPU's vendor, family, model and full feature-flag line (what `-march=native` code depends on);
    the machine type (`platform.machine()`) where /proc/cpuinfo cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().split("\n\n", 1)[0].splitlines()
    except OSError:
        return platform.machine()
    return "\n".join(ln for ln in lines if ln.startswith(("model name", "flags", "vendor_id", "cpu family", "model\t")))
