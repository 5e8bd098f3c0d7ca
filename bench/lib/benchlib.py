"""What every benchmark writes next to its numbers: the commit it ran on, the machine, the
command, mean ± std; the json cache a table is rebuilt from (``--table-only``); where a run
writes (``bench/results``, or ``WORKDIR/quick`` for a ``--quick`` smoke run) and the markdown
table with its hand-written reading.

Example:
    >>> from pathlib import Path
    >>> isinstance(git_commit(Path(".")), str)
    True
    >>> spread([0.5, 0.7, 0.6], digits=2)
    '0.60 ± 0.10 [0.50, 0.70]'
    >>> mean_std([1.0, 2.0, 3.0]), mean_std([1234.0], "{:,.0f}")
    ('2.00 ± 1.00', '1,234')
    >>> widths({"width": [{"kept": 3}, {"kept": 5}], "depth": [{"kept": ["a"]}]})
    '3/5 | blocks 1'
    >>> command_line("-m bench.x", ["--seeds", "0", "1"])
    'python -m bench.x --seeds 0 1'
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

__all__ = ["git_commit", "spread", "mean_std", "widths", "shared_machine", "environment", "host", "command_line", "paired_diff", "paired_ci", "ci_text",
           "record_invocation", "invocations_text", "snapshot_commit", "child_json",
           "pyplot", "save_figure", "load_cache", "save_cache", "save_merged", "locked",
           "RESULTS", "RUNS", "add_quick_flags", "quick_mode", "hand_reading", "kept_reading", "write_md"]

BENCH = Path(__file__).resolve().parents[1]  # bench/ (this file is in bench/lib)
RESULTS = BENCH / "results"  # the committed caches, tables and plots
RUNS = BENCH / "runs"  # not committed: run directories, and the outputs of --quick smoke runs


def git_commit(root: Path) -> str:
    """The short hash of ``root``'s checked-out commit, or "?" outside a git checkout."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def snapshot_commit(src: Path) -> str:
    """The short hash of a package snapshot (``python -m bench.gpu_check --make-baseline COMMIT``
    writes ``COMMIT`` beside its ``src``), or "?" without one."""
    f = src.parent / "COMMIT"
    return f.read_text().strip()[:7] if f.exists() else "?"


def child_json(module: str, args: list[str], pythonpath: list[Path]) -> dict[str, Any]:
    """Run ``python -m module *args`` from the repository root with ``PYTHONPATH`` set to
    ``pythonpath`` (a package snapshot's ``src`` measured in a process of its own) and return
    the json object its last line of output holds; a failure raises with the end of its error
    output."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in pythonpath)}
    done = subprocess.run([sys.executable, "-m", module, *args], cwd=BENCH.parent, env=env, capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{module} {' '.join(args)} with {pythonpath[0]} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def spread(values: list[float], digits: int = 3) -> str:
    """``mean ± std [min, max]`` of several runs (the value alone for one run)."""
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return (f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f} "
            f"[{min(values):.{digits}f}, {max(values):.{digits}f}]")


def mean_std(values: list[float], fmt: str = "{:.2f}") -> str:
    """``mean ± std`` of several runs, each number formatted by ``fmt`` (the value alone for one run)."""
    if len(values) == 1:
        return fmt.format(values[0])
    return f"{fmt.format(statistics.mean(values))} ± {fmt.format(statistics.stdev(values))}"


def widths(structure: dict[str, Any]) -> str:
    """Kept widths per group and blocks per stage of a structure, in model order."""
    w = "/".join(str(g["kept"]) for g in structure.get("width", []))
    d = "/".join(str(len(g["kept"])) for g in structure.get("depth", []))
    return f"{w} | blocks {d}" if d else w


def shared_machine(threads: str) -> str:
    """The machine line of a table run on a CPU shared with other jobs (``threads``: e.g. "1 thread")."""
    import torch

    return (f"{os.cpu_count()} CPUs ({platform.machine()}, shared with other jobs), "
            f"torch {torch.__version__}, {threads}")


def environment(threads: int | None = None, device: str = "cpu") -> dict[str, Any]:
    """Where a row ran, as fields a cache stores beside it: the machine (CPU count and
    architecture), the device (a CUDA device with its name), the torch version and the CPU
    threads (``threads``; ``None``: this process's ``torch.get_num_threads()``).

    Example:
        >>> env = environment(2)
        >>> sorted(env), env["device"], env["threads"]
        (['device', 'machine', 'threads', 'torch'], 'cpu', 2)
    """
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        device = f"{device} ({torch.cuda.get_device_name(torch.device(device))})"
    return {"machine": f"{os.cpu_count()} CPUs ({platform.machine()})", "device": device,
            "torch": torch.__version__, "threads": threads if threads is not None else torch.get_num_threads()}


def host() -> dict[str, Any]:
    """This machine as a cache stores it beside its measurements (platform, CPUs and the usable
    ones, Python, torch), so that a table rebuilt from the cache elsewhere names the machine the
    measurements ran on, not the one that rebuilt it.

    Example:
        >>> sorted(host())
        ['cpus', 'platform', 'python', 'torch', 'usable']
    """
    import torch

    return {"platform": platform.platform(), "cpus": os.cpu_count(), "usable": len(os.sched_getaffinity(0)),
            "python": platform.python_version(), "torch": torch.__version__}


def command_line(script: str, argv: list[str] | None) -> str:
    """The command that ran ``script`` (``argv``: its arguments; ``None``: this process's)."""
    return (f"python {script} " + " ".join(argv if argv is not None else sys.argv[1:])).strip()


def load_cache(path: Path, default: dict[str, Any] | None = None) -> dict[str, Any]:
    """A benchmark's json cache, or ``default`` (an empty one) when there is none yet.

        >>> load_cache(Path("no/such/cache.json"), {"runs": {}})
        {'runs': {}}
    """
    if path.exists():
        return json.loads(path.read_text())
    return {} if default is None else default


def save_cache(path: Path, cache: Any, *, sort_keys: bool = True, end: str = "") -> None:
    """Write the cache (indented by one, sorted keys: small diffs between runs) atomically: a
    process reading it at the same time sees the old file or the new one, never a part.

    ``sort_keys=False`` keeps the insertion order of the caches that were always written so,
    ``end`` is what follows the json (``"\\n"`` for those that end with a newline): the bytes
    of a cache rewritten unchanged stay the same."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(cache, indent=1, sort_keys=sort_keys) + end)
    tmp.replace(path)


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path``'s cache for a read-modify-write shared with other
    invocations running at the same time (a lock file beside it, ``.NAME.lock``; POSIX
    ``flock``, so it is released when the process ends however it ends). Without ``fcntl``
    (Windows) nothing is locked.

        >>> import tempfile
        >>> f = Path(tempfile.mkdtemp()) / "c.json"
        >>> with locked(f):
        ...     save_cache(f, {"runs": {}})
        >>> load_cache(f)
        {'runs': {}}
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    with open(path.with_name(f".{path.name}.lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def save_merged(path: Path, cache: dict[str, Any], key: str, seeds: list[int],
                top: tuple[str, ...] = ("machine",)) -> dict[str, Any]:
    """Read-modify-write of a cache shared by invocations that run at the same time (other
    seeds or other settings): this invocation's ``seeds`` of ``runs[key]``, its ``settings``
    and ``info`` of ``key`` and the ``top`` fields go into what is on disk now; returns it.

    Example:
        >>> import tempfile
        >>> f = Path(tempfile.mkdtemp()) / "c.json"
        >>> save_cache(f, {"runs": {"k": {"0": {"acc": 1}}}, "settings": {}, "info": {}})
        >>> mine = {"runs": {"k": {"1": {"acc": 2}}}, "settings": {"k": {}}, "info": {"k": {}}, "machine": "m"}
        >>> sorted(save_merged(f, mine, "k", [1])["runs"]["k"])
        ['0', '1']
    """
    with locked(path):
        disk = load_cache(path)
        for seed in seeds:
            disk.setdefault("runs", {}).setdefault(key, {})[str(seed)] = cache["runs"][key].get(str(seed), {})
        for field in ("settings", "info"):
            disk.setdefault(field, {})[key] = cache[field][key]
        for field in top:
            disk[field] = cache[field]
        save_cache(path, disk)
    return disk


def pyplot() -> Any:
    """matplotlib.pyplot on the non-interactive Agg backend (imported on first use: the
    benchmarks run without matplotlib until a table is drawn)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, out: Path) -> Path:
    """Lay out ``fig``, write it to ``out`` (110 dpi), close it; every results plot ends here."""
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    pyplot().close(fig)
    return out


def paired_diff(rows: list[dict[str, Any]], base: list[dict[str, Any]], key: str) -> list[float]:
    """Points (x 100) of ``rows[key]`` minus ``base[key]`` for each seed both have, in seed order.

    Example:
        >>> [round(d, 6) for d in paired_diff([{"seed": 1, "acc": 0.8}, {"seed": 0, "acc": 0.9}],
        ...                                   [{"seed": 0, "acc": 0.85}], "acc")]
        [5.0]
    """
    by_seed = {r["seed"]: r[key] for r in base}
    return [100 * (r[key] - by_seed[r["seed"]]) for r in sorted(rows, key=lambda r: r["seed"])
            if r["seed"] in by_seed]


def paired_ci(diffs: list[float], level: float = 0.95) -> tuple[float, float, float, float]:
    """Mean of per-seed paired differences, its two-sided Student-t interval and p-value.

    The interval is ``mean ± t_{(1+level)/2, n-1} * std / sqrt(n)``; the p-value is the
    one-sample t-test of the differences against 0 (``scipy.stats.ttest_1samp``). With one
    difference, or all equal, there is no spread: the interval collapses to the mean and p is
    ``nan``.

    Returns:
        ``(mean, low, high, p)``.

    Example:
        >>> [round(v, 3) for v in paired_ci([1.0, 2.0, 3.0])]
        [2.0, -0.484, 4.484, 0.074]
    """
    from scipy import stats  # the bench and test extras pin it

    n = len(diffs)
    if n == 0:
        raise ValueError("paired_ci: no paired differences (no seed in both arms)")
    mean = statistics.mean(diffs)
    if n == 1 or max(diffs) == min(diffs):
        return mean, mean, mean, float("nan")
    half = float(stats.t.ppf((1 + level) / 2, n - 1)) * statistics.stdev(diffs) / n ** 0.5
    return mean, mean - half, mean + half, float(stats.ttest_1samp(diffs, 0.0).pvalue)


def ci_text(diffs: list[float], level: float = 0.95) -> str:
    """``paired_ci`` as a table cell: ``+mean [low, high], p = P`` (the mean alone for one seed).

    Example:
        >>> ci_text([1.0, 2.0, 3.0]), ci_text([0.5])
        ('+2.00 [-0.48, 4.48], p = 0.074', '+0.50 (1 seed)')
        >>> ci_text([10.0, 11.0, 12.0, 10.5, 11.5])
        '+11.00 [10.02, 11.98], p < 0.001'
    """
    mean, low, high, p = paired_ci(diffs, level)
    if len(diffs) == 1:
        return f"{mean:+.2f} (1 seed)"
    if p != p:  # nan: no spread
        return f"{mean:+.2f} (no spread over {len(diffs)} seeds)"
    ptext = "p < 0.001" if p < 0.001 else f"p = {p:.3f}"
    return f"{mean:+.2f} [{low:+.2f}, {high:+.2f}], {ptext}".replace("[+", "[").replace(", +", ", ")


def record_invocation(info: dict[str, Any], key: str, command: str, commit: str, seeds: list[int]) -> None:
    """Note one invocation of a benchmark under ``info[key]``, keeping the earlier ones.

    The entry's ``command`` / ``commit`` / ``seeds`` and ``env`` (:func:`environment`: machine,
    device, torch version and threads of this process) are the latest invocation's; the earlier
    ones move to its ``earlier`` list (oldest first), so a table built from runs of several
    invocations can name every command, commit and machine it comes from.

    Example:
        >>> info = {}
        >>> record_invocation(info, "t0.5", "python b.py --seeds 0", "aaa", [0])
        >>> record_invocation(info, "t0.5", "python b.py --seeds 1", "bbb", [1])
        >>> invocations_text(info["t0.5"])
        '`python b.py --seeds 0` (commit `aaa`), `python b.py --seeds 1` (commit `bbb`)'
        >>> sorted(info["t0.5"]["env"]) == sorted(info["t0.5"]["earlier"][0]["env"]) == ["device", "machine", "threads", "torch"]
        True
    """
    old = info.get(key)
    earlier = []
    if old:
        earlier = old.get("earlier", []) + [{k: old[k] for k in ("command", "commit", "seeds", "env") if k in old}]
    info[key] = {"command": command, "commit": commit, "seeds": list(seeds), "env": environment(),
                 "earlier": earlier}


def invocations_text(entry: dict[str, Any]) -> str:
    """Every invocation of ``entry`` (see :func:`record_invocation`), oldest first, as markdown."""
    calls = entry.get("earlier", []) + [entry]
    texts = [f"`{c.get('command', '?')}` (commit `{c.get('commit', '?')}`)" for c in calls]
    return ", ".join(dict.fromkeys(texts))  # a rerun that completes a cut-off one is named once


# ----------------------------------------------------------------------------- where a run writes
def add_quick_flags(parser: argparse.ArgumentParser, name: str | None, smoke: str,
                    outputs: str = "cache and table", runs: bool = False) -> None:
    """Add the two flags of a smoke run: ``--quick`` (help ``smoke``: what it shrinks) and
    ``--workdir`` (default ``bench/runs/NAME``; ``name`` None: no default, the script picks
    one from its other flags). A ``--quick`` run's ``outputs`` go to ``WORKDIR/quick``
    (:func:`quick_mode`); ``runs``: the work directory also holds the run directories of real
    runs.

        >>> p = argparse.ArgumentParser()
        >>> add_quick_flags(p, "budget", "one seed, a quarter epoch")
        >>> args = p.parse_args(["--quick"])
        >>> args.quick, args.workdir == RUNS / "budget"
        (True, True)
    """
    parser.add_argument("--quick", action="store_true", help=smoke)
    kind = "run directories" if runs else "scratch directory"
    parser.add_argument("--workdir", type=Path, default=None if name is None else RUNS / name,
                        help=f"{kind}, default bench/runs/{name or 'NAME'} (--quick: its {outputs} "
                             "in WORKDIR/quick)")


def quick_mode(args: argparse.Namespace, results: Path, **smaller: Any) -> Path:
    """The folder this invocation's caches and tables go to.

    A real run: ``results`` (bench/results). A ``--quick`` smoke run: ``WORKDIR/quick``
    (``args.workdir``), after setting ``smaller`` (fewer seeds, shorter epochs) on ``args``;
    the tests run every script this way, and a smoke run neither reads nor writes the
    committed results. The caches then move with the folder: ``CACHE = RESULTS / CACHE.name``.

        >>> args = argparse.Namespace(quick=True, workdir=Path("w"), seeds=[0, 1, 2])
        >>> quick_mode(args, RESULTS, seeds=[0]).as_posix(), args.seeds
        ('w/quick', [0])
        >>> quick_mode(argparse.Namespace(quick=False), RESULTS) == RESULTS
        True
    """
    if not args.quick:
        return results
    for flag, value in smaller.items():
        setattr(args, flag, value)
    return args.workdir / "quick"


def hand_reading(path: Path, strip: bool = True) -> str | None:
    """The hand-written reading kept beside a generated table (``NAME_reading.md``, read
    and, with ``strip``, stripped), or None when there is none; the table prints it after its
    numbers."""
    if not path.is_file():
        return None
    text = path.read_text(encoding="utf-8")
    return text.strip() if strip else text


def kept_reading(md: Path, marker: str = "## Reading") -> str:
    """The hand-written end of a generated md, from ``marker`` on ("" when it has none): a
    table rebuilt from its cache keeps it.

        >>> import tempfile
        >>> f = Path(tempfile.mkdtemp()) / "t.md"
        >>> _ = f.write_text("# t\\n\\n| a |\\n\\n## Reading\\n\\nwords\\n")
        >>> kept_reading(f), kept_reading(f.with_name("none.md"))
        ('## Reading\\n\\nwords\\n', '')
    """
    if not md.is_file():
        return ""
    text = md.read_text(encoding="utf-8")
    return text[text.index(marker):] if marker in text else ""


def write_md(path: Path, lines: list[str], end: str = "\n") -> Path:
    """Write a markdown table: ``lines`` joined by newlines, then ``end``; returns ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + end, encoding="utf-8")
    return path
