"""The run's configuration, one place: :class:`~dmscale.config.run_config.RunConfig` and
its file parsing (:mod:`.run_config`), the one table of the command's options
(:mod:`.options`) and their value converters (:mod:`.values`).

It sits below the tasks (they read their settings from a ``RunConfig``) and above the search
(a ``RunConfig`` builds a ``SearchConfig``). Layer rule: ``config`` imports
:mod:`dmscale.search` and the layers below it, never the tasks, the run or the CLI.
"""
