"""The run's configuration, one place: :class:`~dmscale.config.run_config.RunConfig` and
its file parsing (:mod:`.run_config`) and the one table of the command's options, each
declared once on a field of ``RunConfig`` (:mod:`.options`, with :mod:`.declare`; the search's
own options on :class:`~dmscale.SearchConfig`'s fields; their value converters are
:mod:`dmscale.core.values`).

It sits below the tasks (they read their settings from a ``RunConfig``) and above the search
(a ``RunConfig`` builds a ``SearchConfig``). Layer rule: ``config`` imports
:mod:`dmscale.search` and the layers below it, never the tasks, the run or the CLI.
"""
