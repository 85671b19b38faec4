"""`python -m eval.compare <sweep> [<sweep> ...] | <run_a> <run_b> [--aa <A/A sweep>]`: the paired verdict of the arms.

Finds the runs (numbered subfolders of one or more sweeps, or two run folders), checks that they are one
paired experiment (same items, configs equal outside the arms' switch and the per-run keys in
IGNORED_CONFIG_KEYS; the switch is the loss, or the one other key whose value differs, e.g.
`schedule.updates_per_batch`, with the baseline named `key=value`), pairs each treatment with the
baseline by seed and by item index, decides
with the runs' pre-registered `decision` rule (Holm-adjusted over several treatments; the other
methods are reported as secondary), and writes `compare.json`, `compare.md` and
`compare_plots/*.png` into the output folder, and prints the verdict lines (scope, estimate, the rule's
interval), notes and those paths (`--json`: compare.json itself). Bad input exits with status 2.
A sweep of one loss at several seeds (A/A) gets the between-seed spread instead of a verdict; given
as `--aa` beside an A/B sweep it says whether the A/B gap exceeds that spread.
Every check runs before anything is written, so a refused comparison leaves an existing
compare.json untouched. `--items NAME=FILE[,FILE...] ...` compares per-item files written by other frameworks
instead (eval/items.py, eval/item_formats.py) with the same rule and statistics (eval.comparison.decide;
the typed pipeline: eval/result.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from eval.activity import switch_activity  # noqa: F401 - re-exported
from eval.comparison import (  # noqa: F401 - re-exported: callers and tests import them from eval.compare
    PLOTS_DIR,
    check_options,
    compare_runs,
    decide,
    resolve_rule,
)
from eval.items import ItemsError, compare_item_files, compare_items, items_summary  # noqa: F401 - re-exported
from eval.methods import DECIDING, method_table  # noqa: F401 - method_table re-exported
from eval.result import (  # noqa: F401 - re-exported
    DEFAULT_BOOTSTRAP,
    DEFAULT_BOOTSTRAP_SEED,
    Arms,
    CompareRequest,
    Comparison,
    Rule,
)
from eval.runs import (  # noqa: F401 - re-exported: the runs' API, as eval.compare always offered it
    CompareError,
    Run,
    check_item_sets,
    config_differences,
    discover_runs,
    find_switch,
    flatten,
    load_inputs,
    load_records,
    load_run,
    pair_by_seed,
)
from trainer.config.enums import ENDPOINTS
from trainer.config.ignored_keys import IGNORED_CONFIG_KEYS  # which keys may differ between arms, and why


def compare(paths: list[str | Path], request: CompareRequest | None = None, **options: Any) -> dict[str, Any]:
    """compare.json's dict of `compare_paths` (the python API: `options` are CompareRequest's fields, e.g.
    `compare([sweep], n_bootstrap=0, make_plots=False)`)."""
    return compare_paths(paths, request, **options).to_json()


def compare_paths(paths: list[str | Path], request: CompareRequest | None = None,
                  **options: Any) -> Comparison:
    """Find and load the runs of `paths` (a sweep folder, or two run folders), then compare_runs: every
    check, the statistics, and compare.json / compare.md / plots written (into request.out, default the
    sweep or the runs' common parent).

    The decision rule comes from the runs' `decision` config; the request's method/alpha/margin/endpoint/
    step/threshold/baseline/equivalence_margin must equal it unless override_decision (then the report says
    what changed)."""
    if request is not None and not isinstance(request, CompareRequest):
        raise TypeError(f"compare: request must be a CompareRequest, got {type(request).__name__} (pass the "
                        "options by keyword: compare(paths, treatment=..., n_bootstrap=...))")
    try:
        req = replace(request or CompareRequest(), **options)
    except TypeError as e:
        raise CompareError(f"compare: {e}") from None
    check_options(req.alpha, req.n_bootstrap)
    given = req.treatments()
    # before reading any run: the options alone are wrong
    if req.baseline is not None and req.baseline in given:
        raise CompareError(f"--treatment and --baseline are both '{req.baseline}'")
    resolved = [Path(p).resolve() for p in paths]
    runs, out_dir = load_inputs(resolved, req.eval_name, req.out)
    return compare_runs(runs, out_dir, req, paths=resolved)


def request_from_args(args: argparse.Namespace) -> CompareRequest:
    """The command line's options as a CompareRequest."""
    return CompareRequest(
        treatment=args.treatment, baseline=args.baseline, method=args.method, alpha=args.alpha,
        margin=args.margin, equivalence_margin=args.equivalence_margin, endpoint=args.endpoint,
        step=args.step,
        threshold=args.threshold, override_decision=args.override_decision, n_bootstrap=args.bootstrap,
        seed=args.seed, aa=args.aa, eval_name=args.eval_name, allow_config_diff=args.allow_config_diff,
        allow_mixed_loss_paths=args.allow_mixed_loss_paths, make_plots=not args.no_plots, out=args.out,
        fmt=args.format, metric=args.metric, plan=args.decision)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.compare", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Config keys allowed to differ between runs: "
                                       + ", ".join(IGNORED_CONFIG_KEYS))
    p.add_argument("paths", nargs="*",
                   help="a sweep folder (A/B or A/A), several (the seeds of later looks, run as new sweeps), "
                        "or two run folders")
    p.add_argument("--treatment", default=None,
                   help="loss(es) of the treatment arm(s), comma-separated (default: every loss but the baseline)")
    p.add_argument("--baseline", default=None, help="loss of the baseline arm (default: decision.baseline)")
    p.add_argument("--aa", default=None, metavar="SWEEP",
                   help="an A/A sweep (one loss, >= 2 seeds) of this experiment: say whether the gap exceeds its "
                        "between-seed spread")
    p.add_argument("--eval-name", default=None,
                   help="eval file eval/<NAME>.jsonl (default: config eval.name)")
    p.add_argument("--allow-config-diff", action="store_true",
                   help="compare even if configs differ outside the loss group (recorded in the report)")
    p.add_argument("--allow-mixed-loss-paths", action="store_true",
                   help="compare even if the runs computed their loss on different paths (loss/path)")
    rule = p.add_argument_group("decision rule (default: the runs' pre-registered `decision` config; a "
                                "different value needs --override-decision)")
    rule.add_argument("--method", default=None, choices=("auto", *DECIDING))
    rule.add_argument("--alpha", type=float, default=None, help="two-sided error rate")
    rule.add_argument("--margin", type=float, default=None, help="gain the lower bound must exceed")
    rule.add_argument("--equivalence-margin", type=float, default=None,
                      help="`equivalent` when the rule's interval lies inside +-this gain")
    rule.add_argument("--endpoint", default=None, choices=ENDPOINTS)
    rule.add_argument("--step", type=int, default=None, help="eval step of --endpoint step")
    rule.add_argument("--threshold", type=float, default=None,
                      help="accuracy of the steps-to-threshold endpoint (reported only: no override needed)")
    rule.add_argument("--override-decision", action="store_true",
                      help="decide with the rule given here instead of the pre-registered one (the report says so)")
    p.add_argument("--bootstrap", type=int, default=None,
                   help=f"bootstrap resamples (default: {DEFAULT_BOOTSTRAP} where the bootstrap decides, "
                        "and the descriptive bootstraps skipped; a number runs every bootstrap at it; 0 = "
                        "off; another value is an override when the bootstrap decides)")
    p.add_argument("--seed", type=int, default=DEFAULT_BOOTSTRAP_SEED,
                   help="bootstrap RNG seed (another value is an override when the bootstrap decides)")
    p.add_argument("--out", default=None,
                   help="output folder (default: the sweep, or the runs' common parent)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--no-wandb", action="store_true",
                   help="do not log the comparison to wandb (default: logged when the arms logged to wandb)")
    p.add_argument("--json", action="store_true",
                   help="print compare.json on stdout (default: the verdict lines, notes and the report's paths)")
    items = p.add_argument_group("runs trained elsewhere: per-item result files (eval/items.py, "
                                 "docs/verdict.md)")
    items.add_argument("--items", nargs="+", default=None, metavar="NAME=FILE[,FILE...]",
                       help="two or more arms (or one arm at >= 2 seeds), each its per-item files, one per "
                            "seed")
    items.add_argument("--format", default=None, help="the files' format (default: detected from the file)")
    items.add_argument("--metric", default=None,
                       help="the per-item metric (default: the format's primary one)")
    items.add_argument("--decision", default=None, metavar="PLAN.yaml",
                       help="the pre-registered rule: a YAML of the decision block's keys")
    args = p.parse_args(argv)
    if args.items is not None:
        return _main_items(args)
    if not args.paths:
        p.error("give a sweep folder, two run folders, or --items")
    items_only = [k for k, v in (("--format", args.format), ("--metric", args.metric),
                                 ("--decision", args.decision)) if v is not None]
    if items_only:  # a sweep's rule is its runs' own `decision` block, its scores their eval files
        print(f"eval.compare: error: {', '.join(items_only)}: for --items only, not for sweep folders",
              file=sys.stderr)
        return 2
    try:
        c = compare_paths(args.paths, request_from_args(args))
        result = c.to_json()
    except (CompareError, ValueError, FileNotFoundError) as e:
        print(f"eval.compare: error: {e}", file=sys.stderr)
        return 2
    if not args.no_wandb:
        from eval.wandb_log import log_compare

        try:
            log_compare(result)
        except Exception as e:  # noqa: BLE001 - compare.json/compare.md are written; say what failed
            print(f"eval.compare: the comparison was not logged to wandb: {type(e).__name__}: {e}",
                  file=sys.stderr)
    print(json.dumps(result, indent=2, sort_keys=True) if args.json else summary(c))
    return 0


def _main_items(args: argparse.Namespace) -> int:
    """`--items`: the verdict on per-item files (eval.items); the sweep-only options are refused."""
    sweep_only = {"paths": args.paths, "--treatment": args.treatment, "--aa": args.aa,
                  "--eval-name": args.eval_name, "--endpoint": args.endpoint, "--step": args.step,
                  "--threshold": args.threshold, "--allow-config-diff": args.allow_config_diff,
                  "--allow-mixed-loss-paths": args.allow_mixed_loss_paths}
    given = [k for k, v in sweep_only.items() if v]
    try:
        if given:
            raise ItemsError(f"{', '.join(given)}: for sweep folders only, not for --items")
        c = compare_item_files(args.items, request_from_args(args))
    except (CompareError, ValueError) as e:
        print(f"eval.compare: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(c.to_json(), indent=2, sort_keys=True) if args.json else items_summary(c, summary))
    return 0


def summary(c: Comparison) -> str:
    """What a person reads first: each verdict with its scope, the rule's estimate and interval, the rule and
    any override, the notes, and where the report, the JSON and the plots are."""
    from eval.report import verdict_line

    out_dir = Path(c.output_dir)
    rule = c.rule
    if c.mode == "aa":
        aa = c.aa
        sd = aa["between_seed_sd"]
        lines = [(f"A/A: {aa['loss']} at seeds {aa['seeds']}: between-seed sd of the endpoint "
                  f"{100 * sd:.2f} pts, largest seed-pair gap {100 * aa['max_abs_pair_diff']:.2f} pts "
                  f"({aa['pairs_item_level_significant']} of {len(aa['pairs'])} seed pairs item-level 'significant')")]
    else:
        lines = [verdict_line(r, rule) for r in c.rows]
        lines.append(f"rule: {rule.text()}" + (f" ({rule.resolution})" if rule.requested == "auto" else ""))
    if rule.overridden:
        lines.append("OVERRIDDEN (not the pre-registered comparison): " + "; ".join(rule.overridden))
    lines += [f"note: {n}" for n in c.notes]
    lines += [f"compare.md: {out_dir / 'compare.md'}", f"compare.json: {out_dir / 'compare.json'}"]
    if c.plots:
        lines.append(f"plots: {out_dir / PLOTS_DIR} ({', '.join(sorted(c.plots))})")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
