"""Every results table of ``bench/``: its name, the script that runs it, its cache, the files it
writes and the question it answers, read by ``python -m bench list | table NAME | run NAME``.

A table is rebuilt from its cache by its script's own rebuild flags (:attr:`Table.rebuild`,
``--table-only`` or ``--table`` plus the flags that select the cache entry), in this process,
so that ``python -m bench table NAME`` runs nothing: it reads the json and rewrites the md (and
the script's own plot). A table without a cache (``rebuild`` is ``None``) is rerun to be rebuilt.

Example:
    >>> TABLES["peers"].module, TABLES["peers"].caches, TABLES["peers"].outputs
    ('bench.peers', ('peers.json',), ('peers.md',))
    >>> TABLES["np_uniform_w4"].rebuild
    ('--width', '4', '--table-only')
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Table", "TABLES", "table"]


@dataclass(frozen=True)
class Table:
    """One results table: ``caches`` and ``outputs`` are file names under ``bench/results``;
    ``rebuild``: the script's arguments that rewrite ``outputs`` from ``caches`` (None: no cache)."""

    name: str
    module: str
    caches: tuple[str, ...]
    outputs: tuple[str, ...]
    question: str
    rebuild: tuple[str, ...] | None = ("--table-only",)


def _t(name: str, script: str, caches: tuple[str, ...], outputs: tuple[str, ...], question: str,
       rebuild: tuple[str, ...] | None = ("--table-only",)) -> Table:
    return Table(name, f"bench.{script}", caches, outputs, question, rebuild)


_SPECS: tuple[Table, ...] = (
    _t("gates", "gates", ("gates.json",), ("gates.md", "gates.png"),
       "Table 1: does DMS_p- beat the other gradient-based gates at equal MACs?"),
    _t("gates_settle0.4", "gates", ("gates.json",), ("gates_settle0.4.md", "gates_settle0.4.png"),
       "Table 1 with the settle phase", ("--settle", "0.4", "--table-only")),
    _t("gates_settle0.4_hold", "gates", ("gates.json",), ("gates_settle0.4_hold.md", "gates_settle0.4_hold.png"),
       "Table 1 with the settle phase and its hold", ("--settle", "0.4", "--settle-hold", "--table-only")),
    _t("importance", "importance", ("importance.json", "np_uniform_w4.json"), ("importance.md", "importance.png"),
       "which element importance metric finds the best structure?"),
    _t("evolution", "evolution", ("evolution.json",), ("evolution.md", "evolution.png"),
       "Table 3: DMS_p- against an evolutionary search at equal CPU time"),
    *(_t(name, "evolution", (f"{name}.json",), (f"{name}.md", f"{name}.png"), question,
         (*flags, "--name", name, "--table-only"))
      for name, flags, question in (
          ("evolution_long", ("--generations", "20"), "Table 3 with a 2x longer evolution"),
          ("evolution_settle", ("--settle", "0.4"), "Table 3 with the settle phase"),
          ("evolution_settle_long", ("--settle", "0.4", "--generations", "100"),
           "Table 3 with the settle phase against a 10x longer evolution"),
          ("evolution_d20", ("--settle", "0.4", "--settle-hold", "--generations", "100", "--max-seconds", "1200"),
           "Table 3 at the current defaults, ResNet-20 (the control of evolution_d56)"),
          ("evolution_d56", ("--depth", "56", "--settle", "0.4", "--settle-hold", "--generations", "100",
                             "--max-seconds", "1200"), "Table 3 on a deeper supernet, ResNet-56"),
          ("evolution_d56_long", ("--depth", "56", "--settle", "0.4", "--settle-hold", "--generations", "200",
                                  "--max-seconds", "1200"),
           "Table 3 on ResNet-56 against a 2x longer evolution"))),
    _t("np_uniform", "np_uniform", ("np_uniform.json",), ("np_uniform.md", "np_uniform.png"),
       "issue table 3: does DMS_np beat uniform width scaling (digits, width 8)?"),
    _t("np_uniform_mnist", "np_uniform", ("np_uniform_mnist.json",), ("np_uniform_mnist.md", "np_uniform_mnist.png"),
       "issue table 3 on MNIST", ("--task", "mnist", "--train-limit", "10000", "--search-epochs", "5",
                                  "--retrain-epochs", "10", "--table-only")),
    _t("np_uniform_w4", "np_uniform", ("np_uniform_w4.json",), ("np_uniform_w4.md", "np_uniform_w4.png"),
       "issue table 3 at width 4", ("--width", "4", "--table-only")),
    _t("scaling_claim", "scaling_claim", ("scaling_claim.json",), ("scaling_claim.md",),
       "issue 50: does searching an enlarged supernet beat training the baseline longer?"),
    _t("peers", "peers", ("peers.json",), ("peers.md",),
       "Table 4: DMS_p against Torch-Pruning, uniform width and FastNAS at equal MACs"),
    _t("peers_diag", "peers", ("peers_diag.json",), ("peers_diag.md",),
       "issue 56: why do the structures lose to FastNAS?", ("--name", "peers_diag", "--table-only")),
    _t("search_trace_diag", "search_trace_diag", ("search_trace_diag.json",), ("search_trace_diag.md",),
       "issue 56: how does each dimension's ratio move during a search?"),
    _t("random_control", "random_control", ("random_control.json",), ("random_control.md",),
       "issue 50: does the searched structure beat random structures of the same cost?"),
    _t("budget", "budget", ("budget.json",), ("budget.md",),
       "Table 6: does the resource loss alone land on the budget?"),
    _t("table16", "table16", ("table16.json",), ("table16.md", "table16.png"),
       "Table 16: resource-loss weight x structure learning rate"),
    _t("table16_settle", "table16", ("table16_settle.json",), ("table16_settle.md", "table16_settle.png"),
       "Table 16 with the settle phase", ("--name", "table16_settle", "--table-only")),
    _t("schedule", "schedule_ablation", ("schedule.json",), ("schedule.md", "schedule.png"),
       "Table 7: which r_t schedule?"),
    _t("yolo_table11", "yolo_table11", ("yolo_table11.json",), ("yolo_table11.md",),
       "Table 11 analog: YOLOv8n against DMS_np on MNIST detection",
       ("--train", "256", "--val", "64", "--epochs", "20", "--search-epochs", "10", "--batch-size", "8",
        "--augment", "fliplr=0,mosaic=0", "--seeds", "0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "--table-only")),
    _t("deploy_latency", "deploy_latency", ("deploy_latency.json",), ("deploy_latency.md",),
       "is an export at half the MACs twice as fast on a CPU?"),
    _t("deploy_latency_cuda", "deploy_latency", ("deploy_latency_cuda.json",), ("deploy_latency_cuda.md",),
       "the same on a GPU", ("--device", "cuda", "--table-only")),
    _t("deploy_traffic", "deploy_traffic", ("deploy_traffic.json", "deploy_latency_cuda.json"), ("deploy_traffic.md",),
       "how much less memory traffic does an export at half the MACs move?"),
    _t("latency_staircase_cuda", "latency_staircase", ("latency_staircase_cuda.json",), ("latency_staircase_cuda.md",),
       "is a GPU's latency a staircase in the width (run on a GPU)?", None),
    _t("gpu_check_compile", "gpu_check", ("gpu_check_compile.json",), ("gpu_check_compile.md",),
       "Table 8 on a GPU under torch.compile (run on a GPU)", None),
    _t("gpu_profile", "gpu_profile", (), ("gpu_profile.md",), "where the time of one DMS step goes on a GPU", None),
    _t("latency", "latency_fit", (), ("latency.md",), "does the fitted latency model predict the measured one?", None),
    _t("search_overhead", "search_overhead", ("search_overhead.json",), ("search_overhead.md",),
       "Table 8: what does a DMS training step cost in time and memory?"),
    _t("search_proxies", "search_proxies", ("search_proxies.json",), ("search_proxies.md",),
       "what a DMS step adds, measured without a GPU (operators, saved bytes)", None),
    _t("host_time", "host_time", ("host_time.json",), ("host_time.md",),
       "the host time of a DMS step on the real layers", None),
    _t("gpu_check", "gpu_check", ("gpu_check.json",), ("gpu_check.md",), "Table 8 on a GPU", None),
    _t("smollm2_prune", "smollm2_prune", ("smollm2_prune/",), ("smollm2_prune.md",),
       "SmolLM2-135M pruned to 80 % and 50 % of its parameters", ("--table",)),
    _t("smollm2_memory", "smollm2_memory", ("smollm2_memory/",), ("smollm2_memory.md",),
       "peak memory of a SmolLM2-135M search, with and without a teacher", ("--table",)),
    _t("llm_baselines", "llm_baselines", ("llm_baselines/", "smollm2_prune/"), ("llm_baselines.md", "llm_baselines.json"),
       "Table 5 analog, first version: DMS_p against LLM pruning baselines", ("--table",)),
    _t("llm_table5", "llm_table5", ("llm_table5/",), ("llm_table5.md", "llm_table5.json", "llm_table5.png"),
       "Table 5: DMS_p against LLM pruning baselines at equal weight steps", ("--table",)),
    _t("llm_table5_long", "llm_table5", ("llm_table5_long/",), ("llm_table5_long.md", "llm_table5_long.json",
                                                             "llm_table5_long.png"),
       "Table 5 at a 4x longer budget", ("--name", "llm_table5_long", "--table")),
    _t("llm_table5_hold", "llm_table5", ("llm_table5_hold/",), ("llm_table5_hold.md", "llm_table5_hold.json",
                                                             "llm_table5_hold.png"),
       "Table 5 at a 4x longer budget, at the current defaults (settle + hold)",
       ("--name", "llm_table5_hold", "--table")),
    *(_t(name, "llm_table5", (f"{name}/",), (f"{name}.md", f"{name}.json"), question, ("--name", name, "--table"))
      for name, question in (
          ("llm_ratio_split", "issue 48: the 80 % model against the original, 10 search + 60 finetune steps"),
          ("llm_ratio_kd0", "issue 48: the same without distillation"),
          ("llm_ratio_s50", "issue 48: the same with 50 search + 20 finetune steps"),
          ("llm_ratio_lr3", "issue 48: the same at a 3x higher lr"),
          ("llm_ratio_long_hold", "issue 48: the 4x longer budget at the current defaults"))),
    _t("llm_ratio", "llm_ratio", ("llm_table5_hold/", "llm_ratio_split/", "llm_ratio_kd0/", "llm_ratio_s50/",
                                 "llm_ratio_lr3/", "llm_table5_long/", "llm_ratio_long_hold/"), ("llm_ratio.md",),
       "issue 48: is the 80 % model within 1.2 x the original finetuned as long? (rerun: it names this commit)",
       None),
    _t("llm_table7", "llm_table7", ("llm_table7/",), ("llm_table7.md",),
       "Table 7 (LLM): perplexity of the pruned models in llama.cpp's protocol", ("--table",)),
    _t("llamacpp_speed", "llamacpp_speed", ("llamacpp_speed.json",), ("llamacpp_speed.md",),
       "how fast do the exported GGUF files run in llama.cpp?", ("--table",)),
    _t("latency_target", "latency_target", ("latency_target.json",), ("latency_target.md",),
       "are a MACs and a latency budget both met on the model they time?"),
    _t("loader_throughput", "loader_throughput", ("loader_throughput.json",), ("loader_throughput.md",),
       "can the image-folder loader feed a training step?"),
)

TABLES: dict[str, Table] = {t.name: t for t in _SPECS}


def table(name: str) -> Table:
    """The table called ``name``; an unknown name raises with the known ones."""
    if name not in TABLES:
        raise KeyError(f"no table {name!r}; the tables are: {', '.join(TABLES)} (python -m bench list)")
    return TABLES[name]
