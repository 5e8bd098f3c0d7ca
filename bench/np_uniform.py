"""DMS_np vs uniform width scaling at equal MACs, each retrained from scratch the same way
(issue 10, table 3), with the measurements that say why DMS_np does or does not win.

    python -m bench.np_uniform [--quick] [--seeds 0 1 2] [--targets 0.5 0.25]
        [--arms uniform dms dms_expand] [--search-epochs 10] [--retrain-epochs 20] [--table-only]

ResNet-20 (width 8) on the bundled 8x8 digits. Per target t (fraction of the baseline's MACs)
and seed, three structures at t x the baseline's exact MACs:

* ``uniform``: one width multiplier for every dimension (``peers_lib.uniform_structure``);
* ``dms``: DMS_np searched from the baseline itself (``--pipeline np``, target t);
* ``dms_expand``: DMS_np searched from the baseline enlarged by ``--expand`` (default
  width=1.5,depth=2, the paper's protocol) down to t x the *baseline's* MACs (absolute target);
* ``dms_width``: a diagnostic, ``dms`` with ``--search-dims width`` (depth kept whole).

Every structure is then trained from scratch by the same ``dmscale retrain --retrain-init
scratch`` phase (same SGD, lr, cosine schedule, epochs, batches and initialisation seed).
Recorded per DMS search (``np_uniform_lib.TracedPipeline``): the hard cost / target when
the search ends (the loss alone), the finish phase's steps, whether the budget solver ran,
how far each post-hoc step moved the kept fractions, importance stability (Spearman
correlation and kept-set agreement of snapshots at every tenth of the search with the
search's end), and for all arms the retrained model's exact MACs / target and top-1.
Cached per run in ``bench/results/np_uniform.json``; the table goes to
``bench/results/np_uniform.md``. Run directories under ``--workdir`` (default
``bench/runs/np_uniform/``, ignored). ``--quick`` is a smoke run (one seed, target 0.5, half an
epoch of search and of retraining) whose cache, table and plot go to ``WORKDIR/quick/``.
"""

from __future__ import annotations

import argparse
import os
import platform

import torch

from bench.lib import np_uniform_runs as nr
from bench.lib import np_uniform_table
from bench.lib.benchlib import add_quick_flags, command_line, load_cache, locked, quick_mode, save_cache

__all__ = ["main"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_quick_flags(p, "np_uniform", "smoke run: one seed, target 0.5, tiny epochs", "cache, table and plot",
                    runs=True)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--targets", type=float, nargs="+", default=[0.5, 0.25])
    p.add_argument("--arms", nargs="+", choices=nr.ARMS, default=list(nr.ARMS))
    p.add_argument("--search-epochs", type=float, nargs="+", default=[10.0],
                   help="one or more search lengths (a sweep); uniform runs once")
    p.add_argument("--retrain-epochs", type=float, default=20.0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--variant", default="",
                   help="a name for runs of changed code under the same protocol (kept apart in the cache "
                        "and shown as ARM@VARIANT)")
    p.add_argument("--settle", type=float, default=0.0,
                   help="--settle of the DMS searches (0: Eq. 10 to the last step, the protocol of the "
                        "arms without a variant; the @settle rows ran with 0.4); pair it with --variant")
    p.add_argument("--settle-hold", action="store_true",
                   help="hold the structure while the exact cost is inside the band (SearchConfig.settle_hold, "
                        "the library default since it was added; the @settle rows ran without it, the @hold "
                        "rows with it); pair it with --settle 0.4 and --variant")
    p.add_argument("--table-only", action="store_true")
    p.add_argument("--task", choices=("digits", "mnist"), default="digits",
                   help="digits (the default; np_uniform.json / .md) or mnist (np_uniform_mnist.json / .md)")
    p.add_argument("--width", type=int, default=8,
                   help="base width of the ResNet-20 (8: np_uniform[.json/.md]; others: np_uniform_wW)")
    p.add_argument("--train-limit", type=int, default=None,
                   help="train on the first N training images (--train-limit of every search and retrain)")
    args = p.parse_args(argv)
    if args.task == "digits" and args.train_limit is not None:
        p.error("--train-limit is for --task mnist (the digits cache holds full-split runs)")
    results = quick_mode(args, nr.RESULTS, seeds=[0], targets=[0.5], search_epochs=[0.5], retrain_epochs=0.5)
    nr.use(args.task, args.width, args.train_limit, results, args.workdir)
    torch.set_num_threads(args.threads)
    results.mkdir(parents=True, exist_ok=True)
    machine = (f"{os.cpu_count()} CPUs ({platform.machine()}), torch {torch.__version__}, "
               f"{args.threads} thread(s)")
    if not args.table_only:
        base = nr.baseline()
        for seed in args.seeds:
            for target in args.targets:
                for arm in args.arms:
                    for s_ep in (args.search_epochs[:1] if arm == "uniform" else args.search_epochs):
                        s_key = 0.0 if arm == "uniform" else s_ep
                        name = f"{arm}@{args.variant}" if args.variant else arm
                        key = nr.run_key(name, target, seed, s_key, args.retrain_epochs)
                        if key in load_cache(nr.CACHE, {"runs": {}})["runs"]:
                            continue
                        row = nr.run_arm(arm, target, seed, s_key, args.retrain_epochs, args.threads, base,
                                      args.settle, args.settle_hold)
                        row["arm"] = name
                        nr.store(key, row, machine)
                        extra = (f", search end {row['search_end']:.2f} x, finish {row['finish_steps']} steps, "
                                 f"solver {row['solver_ran']}") if arm != "uniform" else ""
                        print(f"{key}: top-1 {100 * row['acc']:.2f} %, exported {row['exported']:.3f} x target"
                              f"{extra} ({row['search_seconds']} + {row['retrain_seconds']} s)", flush=True)
    np_uniform_table.RESULTS = results  # the table and plot go beside the cache
    command = command_line("-m bench.np_uniform", argv)
    with locked(nr.CACHE):
        cache = load_cache(nr.CACHE, {"runs": {}})
        if not args.table_only:  # the last invocation that ran something (--table-only keeps it)
            cache["last_command"] = command
            save_cache(nr.CACHE, cache)
    command = cache.get("last_command", command)
    name = nr.CACHE.stem
    print(f"wrote {np_uniform_table.write_table(cache, command, args.search_epochs[0], args.retrain_epochs, name=name, dataset=nr.dataset_note(args.task, args.train_limit), width=args.width)}")


if __name__ == "__main__":
    main()
