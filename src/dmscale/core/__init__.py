"""The method itself, in plain torch: the differentiable top-k (:mod:`.topk`, Eq. 1-3 of
the paper), the importance update (:mod:`.importance`, Eq. 4), every gate of a model batched in one
matrix (:mod:`.gate_bank`), the masks a search puts into a model (:mod:`.masks` with its
hooks :mod:`.mask_hooks`, attached and detached by :mod:`.hook_attach`, weight folds
:mod:`.weight_masks` and masked norms :mod:`.masked_norm`, compiled by :mod:`.fused_norms`),
process-group helpers (:mod:`.distributed`), train/eval modes (:mod:`.modes`), the errors
every layer raises (:mod:`.errors`), and options declared on dataclass fields
(:mod:`.options`) with their value converters (:mod:`.values`), which the search declares
and the configuration reads.

Layer rule: ``core`` imports nothing else of dmscale; every other layer may import it.
"""
