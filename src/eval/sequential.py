"""Sequential looks (decision.looks): deciding at a few planned seed counts, adding seeds until the answer is
clear, without raising the false-positive rate above the rule's.

The boundary. decision.looks = [S_1 < ... < S_K] seeds per arm. The rule's two-sided alpha is spent over the
looks by the Lan & DeMets (1983) O'Brien-Fleming-like spending function
    alpha(t) = 2 - 2 Phi(z_{1 - alpha/2} / sqrt(t)),   t = S_k / S_K (the information fraction),
and look k decides at level alpha_k = alpha(t_k) - alpha(t_{k-1}), with the rule's own test at that level
(seed t's interval at 1 - alpha_k; Holm's step-down inside it with several treatments). The looks are
combined by the union bound, not by the joint normal law of the successive statistics: the chance of a
false `validated` at some look is at most sum_k alpha_k / 2 = alpha / 2 whatever the correlation between
looks and whatever the test's small-sample law, because each look's test holds its own level exactly
(seed t under normal seed noise, the sign-flip test under symmetric noise). The union bound costs little
under this spending function: it spends almost nothing early (at [3, 6, 10] seeds: 0.00035, 0.0111 and
0.0386 of alpha = 0.05), so the last look decides at 0.0386 instead of 0.05. Boundaries computed from the
joint law (Jennison & Turnbull 2000, ch. 7) would need the statistics' correlation under 2-9 df of seed
noise, which is exactly what a few seeds cannot pin down.

The record. A decision is known by its comparison (the experiment, the arms, the item set's hash, the
endpoint and the setting the arms share: `ledger_key`) and its exact seed set; re-running compare on the
same seeds is the same decision re-read, any other seed set is another decision. Each decision is written
twice:
- into every run folder that took part, `looks.json` (RUN_RECORD), so the record travels with the data:
  moving, renaming or copying the training tree, or deleting the ledger, keeps the count;
- into a ledger in the folder above the runs' sweep folders (the folder that holds `multirun/` or
  `outputs/`, where training ran; the runs' run_info.json `run_dir` says where that is, so runs linked or
  copied elsewhere still find it; the runs' present folder once that is gone), `.pairedrl/looks/<key>.json`,
  which also holds the decisions made on other runs of the same comparison (a new sweep of other seeds).
With decision.looks a planned look decided once cannot be decided again on another seed set (compare
refuses it: re-rolling a look until it validates spends alpha the plan does not have); without it, every
decision on another seed set is counted and its cost said (family_wise_alpha).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import itertools
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from statistics import NormalDist
from typing import Any

from eval.runs import ignored_key
from trainer.utils.io import atomic_write_json

_N = NormalDist()
LEDGER_DIR = Path(".pairedrl") / "looks"


def spending(t: float, alpha: float) -> float:
    """The O'Brien-Fleming-like spending function alpha(t) (two-sided), alpha(1) = alpha."""
    if t <= 0:
        return 0.0
    return min(alpha, 2.0 - 2.0 * _N.cdf(_N.inv_cdf(1.0 - alpha / 2.0) / math.sqrt(t)))


def look_levels(looks: list[int], alpha: float) -> list[float]:
    """The two-sided level each look decides at: the spending function's increments (they sum to alpha)."""
    last = looks[-1]
    spent = [spending(s / last, alpha) for s in looks]
    return [spent[0]] + [b - a for a, b in itertools.pairwise(spent)]


def look_index(looks: list[int], n_seeds: int) -> int | None:
    """Which look (0-based) a comparison at n_seeds seeds per arm is; None when n_seeds is no planned look."""
    return looks.index(n_seeds) if n_seeds in looks else None


def ledger_root(run_dirs: list[Path]) -> Path:
    """The folder training ran from: the nearest folder above the first run that holds `multirun/` or
    `outputs/` (Hydra's default output trees); the run's grandparent when there is none."""
    first = run_dirs[0]
    for a in first.parents:
        if (a / "multirun").is_dir() or (a / "outputs").is_dir():
            return a
    return first.parent.parent if len(first.parents) > 1 else first.parent


def ledger_key(
    experiment: Any, baseline: str, treatments: list[str], item_set_sha256: str, endpoint: str,
    setting_sha256: str | None = None,
) -> str:
    """The comparison a decision belongs to. `setting_sha256` (`setting_sha256`) tells apart comparisons of
    one experiment at different settings (the mismatch ladder's levels: the same arms, items and endpoint
    under another `backend.sampler_logit_noise`), which are different questions, not looks at one."""
    fields = [experiment, baseline, sorted(treatments), item_set_sha256, endpoint]
    blob = json.dumps(fields if setting_sha256 is None else [*fields, setting_sha256])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


#: Keys that may change between two decisions of one comparison without making it another comparison:
#: besides those compare ignores between arms (the switch, seed, paths, logger), the rule itself (editing
#: `decision` must not reset the count of looks), whether and how the runs were gated, intermediate evals,
#: retries and injected faults (recovered from checkpoints).
SETTING_IGNORED_KEYS: tuple[str, ...] = ("decision", "preflight", "eval.every", "retry", "backend.faults",
                                         "backend.call_deadline_s")


def setting_sha256(flat_config: dict[str, Any], ignore: tuple[str, ...]) -> str:
    """A hash of the baseline arm's resolved config (dotted keys) without `ignore` and SETTING_IGNORED_KEYS:
    what the compared arms share and their comparison is about."""
    drop = (*ignore, *SETTING_IGNORED_KEYS)
    kept = {k: v for k, v in flat_config.items() if not ignored_key(k, drop)}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()


#: the decisions a run folder took part in (eval.compare writes it; it moves with the run)
RUN_RECORD = "looks.json"


def read_ledger(path: Path) -> list[dict[str, Any]]:
    """The decisions a ledger holds (entries without an integer n_seeds are skipped)."""
    if not path.is_file():
        return []
    try:
        looks = json.loads(path.read_text()).get("looks")
    except (OSError, ValueError, AttributeError):
        return []
    return [x for x in looks or [] if isinstance(x, dict) and isinstance(x.get("n_seeds"), int)]


def read_run_records(run_dir: Path, key: str) -> list[dict[str, Any]]:
    """The decisions of comparison `key` that the run folder took part in (its RUN_RECORD)."""
    return [x for x in _run_decisions(run_dir / RUN_RECORD) if x.get("key") == key]


def _run_decisions(path: Path) -> list[dict[str, Any]]:
    """A RUN_RECORD's decisions; a file that is there but unreadable is an error, not an empty record (it
    would reset the count)."""
    if not path.is_file():
        return []
    try:
        found = json.loads(path.read_text()).get("decisions")
    except (OSError, ValueError, AttributeError) as e:
        raise ValueError(f"{path}: not a readable decisions record ({e}); restore it from a copy of the run "
                         "(it counts the decisions this run took part in)") from None
    return [x for x in found or [] if isinstance(x, dict) and isinstance(x.get("n_seeds"), int)]


def seed_set(entry: dict[str, Any]) -> tuple[int, ...] | None:
    """A decision's seed set (sorted), None for a record that predates seed sets."""
    seeds = entry.get("seeds")
    if not isinstance(seeds, list) or not all(isinstance(x, int) for x in seeds):
        return None
    return tuple(sorted(seeds))


def same_decision(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """The same seeds per arm and the same seed set (a record without seeds matches on the count alone)."""
    if a["n_seeds"] != b["n_seeds"]:
        return False
    sa, sb = seed_set(a), seed_set(b)
    return sa is None or sb is None or sa == sb


def _add(entries: list[dict[str, Any]], entry: dict[str, Any]) -> list[dict[str, Any]] | None:
    """entries with `entry` added, or None when it is there already (the same decision re-read)."""
    if any(same_decision(x, entry) for x in entries):
        return None
    return sorted([*entries, entry], key=lambda x: (x["n_seeds"], seed_set(x) or ()))


@contextlib.contextmanager
def _folder_locked(folder: Path) -> Iterator[None]:
    """An exclusive lock on `folder` (flock on the directory itself, so nothing is added to it) around a
    read-modify-write of a record in it: two compares deciding at once (levels of one sweep, a script's
    parallel jobs) would otherwise each write the record they read, and the first decision would be lost."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def record_look(path: Path, entry: dict[str, Any], key_fields: dict[str, Any]) -> None:
    """Add `entry` (key, n_seeds, seeds, verdicts, ...) to the ledger unless the same decision (seed set) is
    there already."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with _folder_locked(path.parent):
        looks = _add(read_ledger(path), entry)
        if looks is not None:
            atomic_write_json(path, {**key_fields, "looks": looks})


def record_in_run(run_dir: Path, entry: dict[str, Any]) -> None:
    """Add `entry` to the run folder's RUN_RECORD unless the same decision of the same comparison is there."""
    path = run_dir / RUN_RECORD
    with _folder_locked(run_dir):
        found = _run_decisions(path)
        mine = [x for x in found if x.get("key") == entry["key"]]
        if _add(mine, entry) is None:
            return
        atomic_write_json(path, {"decisions": [*found, entry]})
