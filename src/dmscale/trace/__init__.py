"""How dmscale reads a model nobody here wrote: the tracer (:mod:`.tracer`, with the parameter
bookkeeping of :mod:`.params`) runs one forward pass and records how channels flow, by the rule
table of torch functions (:mod:`.rules`, with the layout rules of :mod:`.shape_rules` and the
shared helpers of :mod:`.rule_base`) and the layer handlers (:mod:`.handlers`: torch layers,
norms, attention families, each registering itself); :mod:`.graph` holds the labels,
:mod:`.values` the helpers for the values a call passes around. :mod:`.discover` turns a trace
into the searchable dimensions (:mod:`.space`): channel groups and heads (:mod:`.slots`),
residual blocks and stages (:mod:`.blocks`); :mod:`.flops` counts a forward pass.

Layer rule: ``trace`` imports only :mod:`dmscale.core`.
"""
