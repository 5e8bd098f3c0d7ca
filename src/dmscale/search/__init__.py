"""The search: :class:`~dmscale.search.searcher.Searcher` and ``prepare``
(:mod:`.searcher`), its options (:mod:`.config`: ``SearchConfig``), how a model is set up for
it (:mod:`.setup`), the costs of its masks (:mod:`.costs`), its budget: targets, resource loss,
schedule and settle phase (:mod:`.budget`), the saved config's comparison for resuming
(:mod:`.config_state`), the importance sync across processes (:mod:`.importance_sync`), the
budget solver (:mod:`.solver`), the settle phase (:mod:`.settle`) and uniform scaling
(:mod:`.uniform`).

Layer rule: ``search`` imports :mod:`dmscale.export`, :mod:`dmscale.cost`,
:mod:`dmscale.trace` and :mod:`dmscale.core`; nothing above (no engine, run, tasks or CLI).
"""
