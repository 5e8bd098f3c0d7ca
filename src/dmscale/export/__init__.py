"""From a found structure to files a user loads: the physical export (:mod:`.shrink`), its
verification (:mod:`.verify`) and the search's self-check (:mod:`.selfcheck`), the files
(:mod:`.files`: safetensors + structure.json), Hugging Face directories (:mod:`.hf`,
:mod:`.hf_remote`), ONNX / ``torch.export`` / pickles (:mod:`.deploy`, public as
``dmscale.deploy``) and BatchNorm recalibration (:mod:`.calibrate`).

Layer rule: ``export`` imports :mod:`dmscale.trace` and :mod:`dmscale.core`, never
:mod:`dmscale.cost` (its sibling) or anything above.
"""

from dmscale.export.shrink import SkipBlock, ZeroBranch

# Exports pickled with torch.save before the layered layout name dmscale.export.SkipBlock.
__all__ = ["SkipBlock", "ZeroBranch"]
