"""How dmscale reads a model nobody here wrote: the tracer (:mod:`.tracer`) runs one forward
pass and records how channels flow, by the rule table of torch functions (:mod:`.rules`) and
the layer handlers (:mod:`.handlers`: torch layers, norms, attention families, each
registering itself); :mod:`.graph` holds the labels, :mod:`.discover` turns a trace into the
searchable dimensions (channel groups, heads, blocks), :mod:`.flops` counts a forward pass.

Layer rule: ``trace`` imports only :mod:`dmscale.core`.
"""
