"""Runs of the ``dmscale`` command: the pipelines (np, p, p-) of pretraining, searching and
retraining (:mod:`.pipeline`) made of phases (:mod:`.phases`), the run directories as inputs
for export and evaluation (:mod:`.saved_runs`), the report of a run (:mod:`.report`, its
plots :mod:`.report_plots` and phrases :mod:`.report_text`), what a run shows while it trains
and which weights it exports (:mod:`.watching`), and ``dmscale inspect`` / ``show``
(:mod:`.inspect`).

Layer rule: ``run`` may import every layer below it (tasks, config, integrations, search,
engine, data, export, cost, trace, core); only the CLI imports ``run``.
"""
