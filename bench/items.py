"""Reading per-item files for `python -m eval.compare --items`: arms x seeds x items of plain JSONL.

    python bench/items.py [--arms 10] [--seeds 10] [--items 10000] [--format jsonl|lm_eval] [--verdict]

Writes one file per (arm, seed) into a temporary folder (plain JSONL: item_id, correct; or lm-eval
`--log_samples` lines of the sample's size, doc and arguments included), then times reading them
(eval.items.load_arms: parse, validate, check ids), pairing and matching the item sets, and stacking the
score matrices the statistics take. `--verdict` also times the whole comparison (the default rule: seed t
over seeds, Holm over the arms - 1 treatments, the descriptive bootstraps at `--bootstrap` resamples).
Prints the load average beside the figures."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def _lm_eval_line(i: int, acc: bool) -> str:
    """A multiple-choice sample as lm-eval 0.4.13 writes it (keys of evaluator.py's `example`)."""
    q = f"Question: what is {i} + {i + 1}?\nAnswer:"
    return json.dumps({
        "doc_id": i, "doc": {"question": q, "choices": ["a", "b", "c", "d"], "label": 1}, "target": "1",
        "arguments": {f"gen_args_{k}": {"arg_0": q, "arg_1": f" {c}"} for k, c in enumerate("abcd")},
        "resps": [[[str(-0.5 - k / 10), "False"]] for k in range(4)],
        "filtered_resps": [[str(-0.5 - k / 10), "False"] for k in range(4)], "filter": "none",
        "metrics": ["acc", "acc_norm"], "doc_hash": "0" * 64, "prompt_hash": "1" * 64,
        "target_hash": "2" * 64, "acc": float(acc), "acc_norm": float(acc)})


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--arms", type=int, default=10)
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--items", type=int, default=10000)
    p.add_argument("--format", choices=("jsonl", "lm_eval"), default="jsonl")
    p.add_argument("--verdict", action="store_true", help="also time the whole comparison")
    p.add_argument("--bootstrap", type=int, default=10000, help="bootstrap resamples of the comparison")
    a = p.parse_args()
    from eval.compare import compare_items
    from eval.items import load_arms, match_items, pair_seeds

    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="bench_items_") as tmp:
        specs, size = [], 0
        t0 = time.perf_counter()
        for arm in range(a.arms):
            files = []
            for s in range(a.seeds):
                c = rng.random(a.items) < 0.4 + 0.01 * arm
                path = Path(tmp) / (f"arm{arm}_seed{s}.jsonl" if a.format == "jsonl" else
                                    f"arm{arm}_seed{s}" / Path("samples_bench_2026-12-07T00-00-00.0.jsonl"))
                path.parent.mkdir(exist_ok=True)
                with path.open("w") as f:
                    for i in range(a.items):
                        line = (json.dumps({"item_id": f"q{i}", "correct": bool(c[i])}) if a.format == "jsonl"
                                else _lm_eval_line(i, bool(c[i])))
                        f.write(line + "\n")
                size += path.stat().st_size
                files.append(str(path))
            specs.append(f"arm{arm}=" + ",".join(files))
        made = time.perf_counter() - t0
        load = os.getloadavg()
        t0 = time.perf_counter()
        arms = load_arms(specs)
        t_read = time.perf_counter() - t0
        seeds = pair_seeds(arms)
        order, _ = match_items(arms)
        stacked = {x.name: np.stack([f.scores_in(order) for f in x.files]) for x in arms}
        t_all = time.perf_counter() - t0
        assert len(seeds) == a.seeds and all(v.shape == (a.seeds, a.items) for v in stacked.values())
        print(f"{a.arms} arms x {a.seeds} seeds x {a.items} items ({a.format}, {size / 1e6:.0f} MB, written "
              f"in {made:.1f} s): read {t_read:.2f} s, read + pair + match + stack {t_all:.2f} s "
              f"(load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; {os.cpu_count()} CPUs)")
        if a.verdict:
            t0 = time.perf_counter()
            res = compare_items(specs, out=Path(tmp) / "out", n_bootstrap=a.bootstrap)
            print(f"whole comparison ({res['decision']['method']}, {len(res['treatments'])} treatments, "
                  f"Holm, {a.bootstrap} bootstrap resamples): "
                  f"{time.perf_counter() - t0:.2f} s (load average now: {os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    main()
