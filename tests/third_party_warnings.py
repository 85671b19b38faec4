"""The warnings other packages print that the tests let through, in one list.

A test that checks a run's stderr for warnings checks only the project's own: a dependency's notice about
its own future (peft deprecating an older transformers that tinker-cookbook pins) must not fail the suite
on the day pip starts resolving that release, while a warning of this project's making still does. Each
entry names the package and the message, so the list says exactly what is tolerated and why.
"""

from __future__ import annotations

import re

# (package, message pattern): a Python warning whose message matches is not the project's own.
THIRD_PARTY: tuple[tuple[str, re.Pattern[str]], ...] = (
    # peft >= 0.22 warns on import when transformers < 5.6; tinker-cookbook pins transformers <= 5.5.4
    ("peft", re.compile(r"Support for Transformers < [\d.]+ is deprecated in PEFT")),
)

# `path:line: SomeWarning: message`, as warnings.showwarning formats it; the next line is the source line
_RECORD = re.compile(r"^(?P<path>.+?):(?P<line>\d+): (?P<category>\w*Warning): (?P<message>.*)$")


def allowed(path: str, message: str) -> bool:
    """Whether a Python warning from `path` with `message` is one of the listed third-party ones."""
    return any(f"/{pkg}/" in path.replace("\\", "/") and pat.search(message) for pkg, pat in THIRD_PARTY)


def own_warning_lines(stderr: str) -> list[str]:
    """The lines of `stderr` that mention a warning or a deprecation and are not a listed third-party one.

    A listed Python warning is dropped with its source line (the indented line warnings.showwarning prints
    after it, such as `  warnings.warn(`); everything else that says "warning" or "deprecated", in any case,
    is kept: logging's WARNING lines, this project's own warnings, and unlisted third-party ones."""
    out: list[str] = []
    skip_source = False
    for line in stderr.splitlines():
        if skip_source and line.startswith((" ", "\t")):
            skip_source = False
            continue
        skip_source = False
        m = _RECORD.match(line)
        if m and allowed(m["path"], m["message"]):
            skip_source = True
            continue
        low = line.lower()
        if "warning" in low or "deprecated" in low:
            out.append(line)
    return out
