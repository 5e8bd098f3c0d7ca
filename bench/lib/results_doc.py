"""``bench/RESULTS.md``, generated from the per-table files of ``bench/results``.

    python -m bench.lib.results_doc --write    # write bench/RESULTS.md
    python -m bench.lib.results_doc --check    # exit 1, naming the first line that differs (default)

Every table of RESULTS.md is copied here from its per-table md in ``bench/results`` (each written
by its script from its json cache), between ``<!-- from: FILE, table N -->`` markers, and every
other number is a ``scripts/doc_numbers.py`` span computed from a json cache. What the sections
say in prose is plain data below (``SECTIONS``: heading, question, the tables of
:mod:`bench.lib.tables` whose rebuild commands they print, files), free of numbers; the
hand-written readings that RESULTS.md held before are the ``*_results_reading.md`` files beside
the tables, linked from each section. ``tests/bench/test_results_doc.py`` checks
that the committed file is what this module writes, and that a number changed in a cached md or
json makes the check fail.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from bench.lib.tables import TABLES

__all__ = ["Include", "Section", "SECTIONS", "ROOT", "OUT", "anchor", "tables", "stray_numbers", "generate", "check",
           "main"]

ROOT = Path(__file__).resolve().parents[2]
OUT = "bench/RESULTS.md"
PLOTS = ("python -m bench.results_plots",)  # the plots of several tables, from their caches


@dataclass(frozen=True)
class Include:
    """Tables of one per-table md: ``which`` is a tuple of table indices, or the start of a
    header row (every table whose header starts so), or ``"all"``."""
    md: str
    which: tuple[int, ...] | str = (0,)
    note: str = ""


@dataclass(frozen=True)
class Section:
    """One section of RESULTS.md: its heading (kept: docs link the anchors), the question the
    table answers, the tables of :mod:`bench.lib.tables` it shows (their rebuild commands come
    from there), what it includes, its plots, the hand-written files beside it, the doc_numbers
    keys it quotes, and any other command its files need (``also``: the plots script)."""
    heading: str
    stem: str
    question: str
    tables: tuple[str, ...]
    include: tuple[Include, ...]
    plots: tuple[str, ...] = ()
    readings: tuple[str, ...] = ()
    numbers: tuple[str, ...] = ()
    also: tuple[str, ...] = ()

    def commands(self) -> list[str]:
        """How each of the section's files is rebuilt: ``python -m bench table NAME`` from its
        cache, or, for a table without one, its rerun."""
        out = []
        for name in self.tables:
            t = TABLES[name]
            out.append(f"`python -m bench table {name}`" if t.rebuild is not None
                       else f"no cache: `python -m bench run {name}` reruns it")
        return out + [f"`{c}`" for c in self.also]


S = Section
I = Include  # noqa: E741
SECTIONS: tuple[Section, ...] = (
    S("Table 1: DMS_p- vs the paper's other gradient-based gates (paper Tables 2 and 12)", "gates",
      "DMS's top-k vs the paper's other gradient-based gates, DMS_p-",
      ("gates", "gates_settle0.4", "gates_settle0.4_hold"),
      (I("gates.md", note="`--settle 0`"), I("gates_settle0.4.md", note="the settle phase annealing alone"),
       I("gates_settle0.4_hold.md", note="the current default, settle + hold")),
      ("gates.png", "gates_settle0.4.png", "gates_settle0.4_hold.png"),
      ("gates_reading.md", "gates_settle0.4_reading.md", "gates_settle0.4_hold_reading.md"),
      ("gates.eq10", "gates.settle", "gates.hold")),
    S("Element importance metrics (paper Table 8, Sec. 5.1)", "importance",
      "DMS_np with the paper's element importance metrics (Taylor, Taylor without moving average, SNIP, "
      "Fisher, static index), retrained from scratch",
      ("importance",), (I("importance.md"),), ("importance.png",),
      ("importance_reading.md",), ("importance.after", "importance.fisher")),
    S("Table 3 analog: search cost of DMS_p- vs evolutionary search (paper Table 3)", "evolution",
      "CPU cost of DMS_p- vs evolutionary search to the same accuracy",
      ("evolution", "evolution_long", "evolution_settle", "evolution_settle_long", "evolution_d20", "evolution_d56",
       "evolution_d56_long"),
      (I("evolution.md"), I("evolution_long.md"), I("evolution_settle.md"), I("evolution_settle_long.md"),
       I("evolution_d20.md", note="ResNet-20 control"), I("evolution_d56.md", note="ResNet-56"),
       I("evolution_d56_long.md", note="ResNet-56, longer evolution")),
      ("evolution.png", "evolution_settle_long.png", "evolution_d56_long.png"),
      ("evolution_reading.md", "evolution_settle_reading.md", "evolution_settle_long_reading.md",
       "evolution_d20_reading.md", "evolution_d56_reading.md", "evolution_d56_long_reading.md"),
      ("evolution.eq10", "evolution.settle_long", "evolution.d56")),
    S("Issue table 3: DMS_np vs uniform width at equal MACs, retrained from scratch", "np_uniform",
      "DMS_np vs uniform width at equal MACs, same from-scratch training",
      ("np_uniform", "np_uniform_w4", "np_uniform_mnist"),
      (I("np_uniform.md", note="digits, width 8"), I("np_uniform_w4.md", (0, 3), note="width 4, with FastNAS"),
       I("np_uniform_mnist.md", note="MNIST")),
      ("np_uniform.png", "np_uniform_w4.png", "np_uniform_mnist.png"), (),
      ("np.expand.t0.25", "np.ceiling", "np.w4")),
    S("The scaling claim (issue 50)", "scaling_claim",
      "DMS_np from `--expand` at the baseline's own MACs vs the hand-designed baseline, both trained from scratch",
      ("scaling_claim",), (I("scaling_claim.md"),)),
    S("Table 4: DMS_p vs Torch-Pruning vs uniform width at equal MACs", "peers",
      "DMS_p vs Torch-Pruning vs uniform width vs ModelOpt FastNAS, same finetune",
      ("peers",),
      (I("peers.md", "| method | top-1 after finetune"),), ("peers.png",), ("peers_reading.md",),
      ("peers.first10", "peers.default", "peers.ceiling", "peers.w4", "peers.fastnas.readme"), also=PLOTS),
    S("Random-architecture control (issue 50)", "random_control",
      "where DMS's structure ranks among random structures of the same search space at the same MACs, "
      "trained the same way",
      ("random_control",), (I("random_control.md", "| arm |"),)),
    S("Structures against FastNAS, diagnosed (issue 56)", "peers_diag",
      "why DMS_p does not lead FastNAS: every arm on one machine's supernets, and the search's trace",
      ("peers_diag", "search_trace_diag"),
      (I("peers_diag.md", "| method | top-1 after finetune"), I("search_trace_diag.md", "all")),
      ("search_trace_diag_w4-t0.25.png", "search_trace_diag_w4-t0.5.png"),
      ("peers_diag_reading.md", "search_trace_diag_reading.md", "peers_structure_setting.md"),
      ("diag.w4", "diag.d32", "diag.w8", "diag.r18")),
    S("Table 6: does the resource loss alone land on the budget?", "budget",
      "does the resource loss alone land on the budget?",
      ("budget",), (I("budget.md", "all"),),
      ("budget.png",), ("budget_reading.md",), ("budget.hold", "budget.others", "budget.gain", "budget.expand"),
      also=PLOTS),
    S("Table 16: resource-loss weight x structure learning rate (paper Table 16)", "table16",
      "resource-loss weight x structure lr, over the paper's grid",
      ("table16", "table16_settle"),
      (I("table16.md", (0, 1), note="`--settle 0`"), I("table16_settle.md", (0, 1), note="settle + hold")),
      ("table16.png", "table16_settle.png"), (), ("table16.acc", "table16.settle")),
    S("Table 7: the r_t schedule, Eq. 10 over the whole search vs its first 60 % then held", "schedule",
      "r_t decayed over the whole search (the paper's schedule) vs over its first part then held; a width-only phase",
      ("schedule",), (I("schedule.md"),), ("schedule.png",)),
    S("Table 11 analog: YOLOv8n vs DMS_np (generated MNIST detection)", "yolo_table11",
      "DMS_np YOLOv8n vs YOLOv8n vs uniform vs a hand-made P3-only YOLOv8n",
      ("yolo_table11",),
      (I("yolo_table11.md"),), ("yolo_table11.png",), (), ("yolo.first", "yolo.default"), also=PLOTS),
    S("Deployment latency at half the MACs (PyTorch and onnxruntime)", "deploy_latency",
      "does half the MACs halve CPU latency?",
      ("deploy_latency",), (I("deploy_latency.md"),),
      ("deploy_latency.png",), ("deploy_latency_reading.md",), ("deploy.cpu",), also=PLOTS),
    S("Latency model: predicted vs measured CPU latency", "latency",
      "does the fitted latency model predict exports?",
      ("latency",),
      (I("latency.md"),)),
    S("Table 8: cost of the method, a DMS training step and its memory vs a plain one", "search_overhead",
      "cost of a DMS training step and its memory vs a plain one",
      ("search_overhead",),
      (I("search_overhead.md", (0, 1)),), ("search_overhead.png",), (),
      ("cpu.step.detail", "cpu.step.commits", "cpu.host", "cpu.proxies"), also=PLOTS),
    S("Table 8 on a GPU: the search step and the exports on one NVIDIA H200 (issue 29)", "gpu_check",
      "a DMS step and exports on a GPU, before and after the GPU work, and the CPU proxies of it",
      ("gpu_check", "gpu_check_compile", "deploy_latency_cuda", "deploy_traffic", "latency_target", "latency_staircase_cuda", "search_proxies", "host_time"),
      (I("gpu_check.md", (0, 1)), I("gpu_check_compile.md", (0,), note="`torch.compile`"),
       I("deploy_latency_cuda.md"), I("deploy_traffic.md"), I("latency_target.md"),
       I("latency_staircase_cuda.md"), I("search_proxies.md", (0, 1)), I("host_time.md")),
      (), ("latency_target_reading.md", "gpu_profile.md"),
      ("gpu.env", "gpu.step", "gpu.memory", "gpu.export", "deploy.cuda.compiled", "latency.target",
       "cpu.host.ratios")),
    S("SmolLM2-135M pruned to 80 % and 50 % of its parameters (DMS_p + distillation)", "smollm2_prune",
      "SmolLM2-135M pruned to two parameter targets with DMS_p and distillation, end to end on a CPU",
      ("smollm2_prune", "smollm2_memory"),
      (I("smollm2_prune.md"), I("smollm2_memory.md")), (), ("smollm2_prune_notes.md",)),
    S("Table 7 at CPU scale: SmolLM2-135M, Alpaca finetune, WikiText-2 / PTB / zero-shot (issue 55)", "llm_table7",
      "the paper's LLM protocol at CPU scale: Alpaca finetune with the original as teacher, WikiText-2 / "
      "PTB perplexity and zero-shot accuracy",
      ("llm_table7",), (I("llm_table7.md", (0, 1)),), (), ("llm_table7_notes.md",),
      ("llm7.t0.81", "llm7.t0.5")),
    S("Table 5: SmolLM2-135M, DMS_p against LLM pruning baselines at equal weight steps (longer protocol)",
      "llm_table5",
      "SmolLM2-135M: DMS_p vs Torch-Pruning, Minitron-style, LLM-Pruner-style Taylor, L2 magnitude, ShortGPT, "
      "at equal weight steps",
      ("llm_table5", "llm_table5_long", "llm_table5_hold", "llm_ratio"),
      (I("llm_table5.md"), I("llm_table5_long.md", note="a longer budget"),
       I("llm_table5_hold.md", note="the current default"), I("llm_ratio.md", note="against the original")),
      ("llm_table5.png", "llm_table5_long.png", "llm_table5_hold.png"),
      ("llm_table5_notes.md", "llm_table5_long_notes.md", "llm_table5_hold_notes.md"),
      ("llm5.t0.8.headline", "llm5.t0.5", "llm5.widths.t0.8", "llm5.hold.t0.8", "llm5.band")),
    S("Table 5 analog, first version: SmolLM2-135M, DMS_p against LLM pruning baselines at equal parameters",
      "llm_baselines", "the short first version of the LLM table: equal parameters and finetune, one seed",
      ("llm_baselines",), (I("llm_baselines.md"),),
      ("llm_baselines.png",), ("llm_baselines_notes.md",), also=PLOTS),
    S("Image-folder loader throughput vs the training step it feeds", "loader_throughput",
      "can the image-folder loader (`--task imagefolder`) feed a training step?",
      ("loader_throughput",), (I("loader_throughput.md"),)),
    S("llama.cpp speed of a DMS-pruned SmolLM2-135M", "llamacpp_speed",
      "what speed a DMS-pruned SmolLM2-135M gives where it is served (llama.cpp, GGUF, CPU)",
      ("llamacpp_speed",), (I("llamacpp_speed.md", "all"),), (),
      ("llamacpp_speed_reading.md",), ("llamacpp.decode.readme",)),
)

PREAMBLE = """\
# dmscale benchmark results

<!-- generated by `python -m bench.lib.results_doc --write`: edit bench/lib/results_doc.py or a reading file in bench/results, not this file -->

Every table the project has measured, in one place. This file is generated: each table below is
copied from its md in [results/](results/), which its script writes from its json cache (the
command under each heading rebuilds it without running anything), and every other number is a
span that `scripts/doc_numbers.py` computes from a cache. `python -m bench.lib.results_doc --write`
writes this file and `--check` fails on any line that differs (`tests/bench/test_results_doc.py`).
The md files name the commands, commits, seeds and machine of their rows; the readings (setup,
caveats, what the numbers say) are hand-written, in the reading files linked from each section;
the history of the defaults these tables were measured at, and how to read their noise, is in
[overview_results_reading.md](results/overview_results_reading.md). Which script makes which file:
[README.md](README.md).

Where the cached rows ran, as the caches record it: <!-- num:results.machines -->{machines}<!-- /num -->.
"""


NUMBER = re.compile(r"(?<![\w.\-])[+-]?\d+(?:[.,]\d+)*(?![\w])")
NOT_PROSE = (re.compile(r"<!-- from: .*?<!-- /from -->", re.S), re.compile(r"<!-- num:.*?<!-- /num -->", re.S),
             re.compile(r"<!--.*?-->", re.S), re.compile(r"^#.*$", re.M), re.compile(r"`[^`\n]*`"),
             re.compile(r"\[[^\]\n]*\]\([^)\n]*\)"))


def stray_numbers(text: str) -> list[tuple[int, str]]:
    """``(line, number)`` of every number of ``text`` outside a copied table, a ``num:`` span, a
    heading, inline code and a link: numbers the generated file must not hold (each comes from a
    cache, through a table or a span)."""
    def blank(m: re.Match) -> str:
        return re.sub(r"[^\n]", " ", m.group(0))
    for pattern in NOT_PROSE:
        text = pattern.sub(blank, text)
    return [(text.count("\n", 0, m.start()) + 1, m.group(0)) for m in NUMBER.finditer(text)]


def _doc_numbers() -> ModuleType:
    """``scripts/doc_numbers.py``, loaded from its file (scripts/ is no package)."""
    if "doc_numbers" in sys.modules:
        return sys.modules["doc_numbers"]
    spec = importlib.util.spec_from_file_location("doc_numbers", ROOT / "scripts" / "doc_numbers.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["doc_numbers"] = module
    spec.loader.exec_module(module)
    return module


def anchor(heading: str) -> str:
    """The GitHub anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def tables(text: str) -> list[tuple[str, str]]:
    """``(caption, table)`` of every markdown table of ``text``; the caption is the nearest
    heading above it, without its ``#``."""
    out, caption, rows = [], "", []
    for line in text.split("\n") + [""]:
        if line.startswith("|"):
            rows.append(line)
            continue
        if rows:
            out.append((caption, "\n".join(rows)))
            rows = []
        if line.startswith("#"):
            caption = line.lstrip("#").strip()
    return out


def _chosen(include: Include, found: list[tuple[str, str]]) -> list[tuple[int, str, str]]:
    if include.which == "all":
        idx = range(len(found))
    elif isinstance(include.which, str):
        idx = [i for i, (_, t) in enumerate(found) if t.startswith(include.which)]
    else:
        idx = include.which
    if not idx or max(idx) >= len(found):
        raise ValueError(f"{include.md}: expected tables {include.which!r}, found {len(found)} tables; "
                         f"fix the Include in bench/lib/results_doc.py")
    return [(i, *found[i]) for i in idx]


def _included(include: Include, results: Path) -> list[str]:
    path = results / include.md
    if not path.is_file():
        raise FileNotFoundError(f"no {path}: every md a section includes must exist (bench/lib/results_doc.py)")
    note = f" ({include.note})" if include.note else ""
    out = []
    for i, caption, table in _chosen(include, tables(path.read_text(encoding="utf-8"))):
        out += [f"<!-- from: results/{include.md}, table {i + 1} -->", "",
                f"[{include.md}](results/{include.md}){note}: {caption}", "", table, "", "<!-- /from -->", ""]
    return out


def _links(names: tuple[str, ...]) -> str:
    return ", ".join(f"[{n}](results/{n})" for n in names)


def _section(s: Section, results: Path, dn: ModuleType) -> list[str]:
    out = [f"## {s.heading}", ""]
    if s.plots:
        out += [f"![{s.stem}](results/{s.plots[0]})", ""]
    out += [f"- question: {s.question}"]
    out += ["- rebuild: " + "; ".join(s.commands())]
    out += [f"- tables: {_links(tuple(dict.fromkeys(i.md for i in s.include)))}"]
    if s.plots[1:]:
        out += [f"- plots: {_links(s.plots)}"]
    out += [f"- reading: {_links((f'{s.stem}_results_reading.md',) + s.readings)}"]
    out += [f"- from the caches: <!-- num:{k} -->{dn.value(k)}<!-- /num -->" for k in s.numbers]
    out += [""]
    for include in s.include:
        out += _included(include, results)
    return out


def _index() -> list[str]:
    out = ["## Index", "", "| table | files | question |", "| --- | --- | --- |"]
    for s in SECTIONS:
        files = _links(tuple(dict.fromkeys(i.md for i in s.include))[:1])
        out.append(f"| [{s.heading}](#{anchor(s.heading)}) | {files} | {s.question} |")
    return out + [""]


def generate(results: Path | None = None) -> str:
    """The text of RESULTS.md from the md files and json caches in ``results``
    (default ``bench/results``)."""
    results = results or ROOT / "bench" / "results"
    dn = _doc_numbers()
    before = dn.use_results(results)
    try:
        lines = PREAMBLE.format(machines=dn.value("results.machines")).split("\n") + _index()
        for s in SECTIONS:
            lines += _section(s, results, dn)
    finally:
        dn.use_results(before)
    return "\n".join(lines).rstrip("\n") + "\n"


def check(path: Path, results: Path | None = None) -> str | None:
    """None when ``path`` is what ``generate`` gives, else the first line that differs."""
    want = generate(results).split("\n")
    have = path.read_text(encoding="utf-8").split("\n") if path.is_file() else []
    for n, (a, b) in enumerate(zip(have + [None] * len(want), want + [None] * len(have)), 1):
        if a != b:
            return f"{OUT}:{n}: committed {a!r} != generated {b!r} (`python -m bench.lib.results_doc --write`)"
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1 when bench/RESULTS.md differs (default)")
    mode.add_argument("--write", action="store_true", help="write bench/RESULTS.md")
    args = p.parse_args(argv)
    path = ROOT / OUT
    if args.write:
        path.write_text(generate(), encoding="utf-8")
        print(f"wrote {OUT}")
        return 0
    bad = check(path)
    if bad:
        print(bad)
        return 1
    print(f"{OUT} is what its generator writes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
