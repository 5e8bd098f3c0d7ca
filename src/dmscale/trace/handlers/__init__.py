"""Layer handlers: how a layer is traced, pruned and counted. :mod:`.base` holds the
:class:`~dmscale.trace.handlers.base.Handler` record, the registry and torch's own layers;
:mod:`.norms` (LayerNorm, RMSNorm families, probed by their formula) and :mod:`.attention`
(timm, torchvision and Hugging Face attention) register themselves into it on import.
"""
