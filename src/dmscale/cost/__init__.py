"""What a structure costs: the exact count of a model and the differentiable resource model
of a search (:mod:`.resources`: MACs, parameters), the latency model (:mod:`.latency`) with
its measured profile (:mod:`.latency_profile`, :mod:`.timing`) and fit (:mod:`.polyfit`).

Layer rule: ``cost`` imports :mod:`dmscale.trace` and :mod:`dmscale.core`, never
:mod:`dmscale.export` (its sibling) or anything above.
"""
