"""Which config keys do not define what a run computes: three answers, side by side.

Each tuple holds dotted prefixes of the resolved config (`a.b` covers `a.b.*`). They differ because
they answer different questions:

- RESUME_IGNORED_KEYS: may this run folder be resumed with this config? (trainer.checkpoint)
- PLAN_IGNORED_KEYS: do the preflight gates' results hold for this job? (trainer.preflight.gates)
- IGNORED_CONFIG_KEYS: may these runs be compared as arms of one experiment? (eval.compare)

The keys on which they differ, and why (ignored = may differ, hashed = must be equal):

| key               | resume  | plan    | compare | why                                                          |
|-------------------|---------|---------|---------|--------------------------------------------------------------|
| loss, seed        | hashed  | ignored | ignored | a resume continues one arm; plan and comparison span arms    |
| run_name          | hashed  | ignored | ignored | a label: a resumed run keeps the label it started with       |
| retry,            | ignored | ignored | hashed  | changes no number, but compare reports arms run differently  |
| backend.call_deadline_s |   |         |         |                                                              |
| preflight.skip    | ignored | ignored | hashed  | compare reports arms of which only some were gated           |
| preflight.dir     | ignored | ignored | ignored | only where the preflight results are read from               |
| preflight.*       | ignored | hashed  | hashed  | the gates' budget and pilot sizes are the plan               |
| backend.state_dir | hashed  | hashed  | ignored | a per-run output path, which compare sees in every run       |
| backend.faults    | ignored | hashed  | hashed  | faults are recovered from checkpoints; the pilot's timings   |
|                   |         |         |         | depend on them                                               |
| eval.every        | ignored | hashed  | hashed  | adds or drops intermediate evals of a resumed run; the       |
|                   |         |         |         | feasibility gate plans them, compare's endpoints read them   |
| decision          | ignored | hashed  | hashed  | read by eval.compare and the design gate, not by training    |
|                   |         |         |         | (`eval.compare --aa` also ignores it: an A/A sweep measured  |
|                   |         |         |         | under another rule still measures the noise)                 |
| report            | ignored | hashed  | ignored | shapes the per-run report only; the gates do not read it,    |
|                   |         |         |         | the plan hash keeps it so recorded preflights stay valid     |
| logger, resume,   | ignored | ignored | ignored | where metrics go and how the run was started                 |
| checkpoint        |         |         |         |                                                              |
| hydra             | dropped | dropped | ignored | Hydra's runtime section (output dirs, job names)             |

`preflight.*` stands for the other preflight keys (budget_minutes, planned_models, the pilot sizes).
Resume and plan hashes drop `hydra` before hashing; compare ignores it.
"""

from __future__ import annotations

#: What may change between a run and its resume (trainer.checkpoint.config_hash) without changing what
#: is computed: a resume continues the same arm, so the loss, the seed and every setting that shapes
#: training or the final eval stay hashed. eval.every only adds or drops intermediate evals, the
#: decision rule is read by eval.compare alone, the report settings only shape the report, retries
#: the call deadline and injected faults are recovered from checkpoints.
RESUME_IGNORED_KEYS: tuple[str, ...] = ("resume", "checkpoint", "logger", "preflight", "retry", "backend.faults",
                                        "backend.call_deadline_s", "eval.every", "decision", "report")

#: What does not change what the preflight gates measured (trainer.preflight.gates.plan_hash; Hydra's
#: own section is dropped as well). The loss is the swept switch: each gate records every arm's loss
#: config instead (`arm_losses`: the baseline and each treatment), which a sweep job's own loss must
#: equal. A replicate seed changes only the LoRA init and the sampling draws, so one preflight serves a
#: seed sweep. preflight.skip/dir only say whether and where to look. Unlike a resume, the plan keeps
#: eval.every, decision, backend.faults and the other preflight settings: the feasibility gate times the
#: evals and the pilot, and the design gate reads the decision rule.
PLAN_IGNORED_KEYS: tuple[str, ...] = ("loss", "seed", "logger", "retry", "backend.call_deadline_s", "resume",
                                      "checkpoint", "run_name", "preflight.skip", "preflight.dir")

#: What may differ between the runs of one paired experiment (eval.compare.config_differences).
#: Unlike the two hashes above, compare sees the runs' recorded configs, which hold per-run paths
#: (backend.state_dir) and Hydra's section; it keeps retry, preflight.skip, eval.every and
#: backend.faults, so arms run under different settings are reported (`--allow-config-diff` accepts them).
IGNORED_CONFIG_KEYS: tuple[str, ...] = (
    "loss",               # the arm switch itself; each arm's loss group is checked across its seeds, and
                          # the keys both losses have (aggregation) across the arms
    "seed",               # pairs are matched by seed; different seeds are the replication
    "run_name",           # the arm label (derived from loss and seed)
    "resume",             # resuming continues the same computation
    "checkpoint",         # eval.run's input path
    "backend.state_dir",  # per-run output path of the engine's checkpoints
    "preflight.dir",      # where the preflight results were read from
    "logger",             # where metrics go (wandb project/group/run names, mode); no effect on training
    "report",             # whether the per-run report is written; no effect on training
    "hydra",              # Hydra's runtime section (output dirs, job names), if present
)
