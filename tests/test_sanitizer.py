"""The native kernels under AddressSanitizer and UndefinedBehaviorSanitizer: kernels.c is built with
`-fsanitize=address,undefined` and the kernel tests (tests/test_kernels.py) run against that build.

Why: the kernels take raw pointers from ctypes, so an index past a buffer is not an exception but a
wrong number or a crash some time later; the float64 comparisons catch wrong numbers, not a read one
element past the end that happens to land on plausible memory. The sanitized library is loaded through
`kernels.LIBRARY_ENV` into a fresh Python with libasan preloaded (the ASan runtime must come first in
the process, and Python itself is not built with it). Leak checking is off: the interpreter and torch
keep allocations to exit by design, which says nothing about the kernels (they allocate nothing that
outlives a call). A first run feeds the sanitized library one out-of-bounds call to show that a fault
is reported and fails the run, so a passing kernel run means something."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.backends.local import kernels

ROOT = Path(__file__).resolve().parents[1]
SANITIZE = ["-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined", "-fno-sanitize-recover=all"]

pytestmark = pytest.mark.slow


def _gcc() -> str:
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("no gcc: the sanitizer build needs gcc's libasan/libubsan")
    return gcc


def _sanitized_env(tmp_path: Path) -> dict[str, str]:
    """A sanitized build of kernels.c and the environment that runs Python against it."""
    gcc = _gcc()
    lib = tmp_path / "pairedrl_kernels_sanitized.so"
    flags = [f for f in kernels.FLAGS if f != "-O3"] + SANITIZE
    p = subprocess.run([gcc, *flags, "-o", str(lib), str(kernels.SOURCE)], capture_output=True, text=True,
                       timeout=300, check=False)
    assert p.returncode == 0, p.stderr
    libasan = subprocess.run([gcc, "-print-file-name=libasan.so"], capture_output=True, text=True, timeout=30,
                             check=True).stdout.strip()
    if not os.path.isabs(libasan):  # gcc prints the bare name when it has no such runtime
        pytest.skip("gcc has no libasan here")
    env = {k: v for k, v in os.environ.items() if k != kernels.NATIVE_ENV}
    env.update({kernels.LIBRARY_ENV: str(lib), "LD_PRELOAD": libasan,
                "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=0:exitcode=86",
                "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1:exitcode=87",
                "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])})
    return env


def test_kernel_tests_pass_under_address_and_undefined_behaviour_sanitizers(tmp_path):
    env = _sanitized_env(tmp_path)
    # the harness catches a fault: one silu_mul told of a row more than its output holds
    canary = ("import torch\n"
              "from trainer.backends.local import kernels\n"
              "lib = kernels.library()\n"
              "print(kernels.describe(), flush=True)\n"
              "gu, out = torch.randn(4, 64), torch.empty(4, 32)\n"
              "lib.silu_mul(gu.data_ptr(), 64, 0, out.data_ptr(), 5, 32, 1)\n")
    p = subprocess.run([sys.executable, "-c", canary], env=env, capture_output=True, text=True, timeout=300,
                       check=False)
    assert "native (pairedrl_kernels_sanitized.so)" in p.stdout, p.stdout + p.stderr
    assert p.returncode == 86 and "heap-buffer-overflow" in p.stderr, p.stderr[-3000:]
    # the kernel tests against the sanitized build: every native test runs (none skipped for want of it)
    # --capture=sys: a sanitizer writes its report to fd 2 and ends the process, which pytest's fd capture
    # would swallow
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", "-x", "--capture=sys",
                        str(ROOT / "tests" / "test_kernels.py")], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=1800, check=False)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-6000:]
    assert "no native kernels here" not in out and " passed" in out
    assert "AddressSanitizer" not in out and "runtime error" not in out
