"""`raylowcomm tune SWEEP.yaml`: a Ray Tune sweep over any config field.

Each trial is one Tune function trainable that runs the strategies of its config. The trial
reserves, up front, one placement group: an empty bundle for itself plus one bundle per node /
stage actor its strategies start (each `Strategy.bundles`); Ray captures those actors
into it, so trials never compete for half of their actors and a sweep can neither deadlock nor
oversubscribe a small cluster. DDP runs Ray Train, which places its workers in a placement
group of its own (the supported Train-in-Tune pattern); the sweep then caps concurrency so
those fit too.

Sweep file (see tune_configs/):

    base: ../examples/lofi_vs_ddp_mnist.yaml   # run config; relative to this sweep file
    set: {strategies: [lofi], data.train_size: 512}   # fixed overrides, like --set
    space:                                     # dotted config field -> one search space
      nodes.count: {grid: [1, 2]}
      optim.lr: {loguniform: [1.0e-3, 1.0e-1]}  # also: choice: [...], uniform: [lo, hi]
    metric: id_accuracy
    mode: max
    columns: [shift_accuracy, total_bytes]     # optional: more reported metrics in the table
    num_samples: 1                             # repeats of the grid; samples of random spaces
    max_concurrent: null                       # null: as many trials as the cluster fits
    asha: {metric: train_loss, mode: min, grace_period: 1, max_t: 100}   # optional
    storage_path: runs/tune                    # relative to the working directory
"""

from raylowcomm.tune.summary import format_summary, format_trials, plot_sweep
from raylowcomm.tune.sweep import Sweep, SweepConfig, SweepError, load_sweep
from raylowcomm.tune.trials import run_sweep, trial_bundles

__all__ = [
    "Sweep",
    "SweepConfig",
    "SweepError",
    "format_summary",
    "format_trials",
    "load_sweep",
    "plot_sweep",
    "run_sweep",
    "trial_bundles",
]
