"""What an installed copy of the project holds: the wheel built from this tree carries every file of its
packages, not only the Python modules. The local engine compiles `kernels.c` at run time, so a wheel
without it installs and runs, but on the slower torch path with another summation order: nothing fails,
which is why this is checked by building one."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("trainer", "envs", "eval")


def _package_files() -> set[str]:
    """Every file under the packages of src/, as a wheel names it, less the interpreter's byte code."""
    src = ROOT / "src"
    return {p.relative_to(src).as_posix() for pkg in PACKAGES for p in (src / pkg).rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}


def test_the_wheel_carries_every_package_file_the_kernel_source_included(tmp_path):
    # built from a copy: a build in the checkout leaves build/ and egg-info there
    work = tmp_path / "tree"
    work.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, work / name)
    shutil.copytree(ROOT / "src", work / "src", ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp_path / "dist")], cwd=work, capture_output=True, text=True, timeout=300,
                       check=False)
    assert p.returncode == 0, p.stdout + p.stderr
    (wheel,) = (tmp_path / "dist").glob("pairedrl-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "trainer/backends/local/kernels.c" in names
    assert sorted(_package_files() - names) == []


def test_only_listed_third_party_warnings_pass_a_stderr_check():
    """The stderr checks let a listed dependency notice through and nothing else: the project's own
    warnings, logging's WARNING lines and an unlisted package's warning all still count."""
    from third_party_warnings import own_warning_lines

    peft = ("/venv/lib/python3.11/site-packages/peft/import_utils.py:52: FutureWarning: Support for "
            "Transformers < 5.6 is deprecated in PEFT and will be removed in the next release, v1.0.\n"
            "  warnings.warn(\n")
    assert own_warning_lines(peft) == []
    ours = "/repo/src/trainer/loop.py:10: UserWarning: reinit=True is deprecated\n  warnings.warn(\n"
    assert own_warning_lines(ours) == ["/repo/src/trainer/loop.py:10: UserWarning: reinit=True is deprecated",
                                       "  warnings.warn("]
    # the same message from another package is not the listed one
    other = peft.replace("/peft/", "/otherpkg/")
    assert len(own_warning_lines(other)) == 2
    logged = "[2026-12-07 10:00:00][trainer][WARNING] - the machine is contended\n"
    assert own_warning_lines(peft + logged) == [logged.strip()]
