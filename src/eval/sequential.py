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

The ledger. Looks are counted per experiment and comparison (the arms, the items, the endpoint), wherever
the runs were written: a JSON file in the folder above the runs' sweep folders (the folder that holds
`multirun/` or `outputs/`, where training ran; the runs' own run_info.json `run_dir` says where that is,
so runs linked or copied elsewhere still find it), `.pairedrl/looks/<key>.json`. A new sweep folder
with more seeds, or another --out, finds the same ledger; only a comparison at more seeds than the last
recorded look is a new look (re-running compare on the same seeds is the same look).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from pathlib import Path
from statistics import NormalDist
from typing import Any

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
    experiment: Any, baseline: str, treatments: list[str], item_set_sha256: str, endpoint: str
) -> str:
    blob = json.dumps([experiment, baseline, sorted(treatments), item_set_sha256, endpoint])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def read_ledger(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    try:
        looks = json.loads(path.read_text()).get("looks")
    except (OSError, ValueError, AttributeError):
        return []
    return [x for x in looks or [] if isinstance(x, dict) and isinstance(x.get("n_seeds"), int)]


def record_look(path: Path, entry: dict[str, Any], key_fields: dict[str, Any]) -> list[dict[str, Any]]:
    """Add `entry` (n_seeds, seeds, verdicts, output folder) to the ledger unless a look at as many seeds is
    there already (the same look, re-read); returns the earlier looks (fewer seeds than this one)."""
    looks = read_ledger(path)
    earlier = [x for x in looks if x["n_seeds"] < entry["n_seeds"]]
    if not any(x["n_seeds"] == entry["n_seeds"] for x in looks):
        looks = sorted(looks + [entry], key=lambda x: x["n_seeds"])
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, {**key_fields, "looks": looks})
    return earlier
