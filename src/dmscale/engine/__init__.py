"""The engine of a run: one step loop (:mod:`.loop`), where and how steps run
(:mod:`.device`: device, threads, autocast, GradScaler, torch.compile), and the run
directory with its checkpoint, RNG state, stop signals and progress (:mod:`.rundir`),
evaluations during training and the best weights (:mod:`.evaluation`, ``--eval-every``) and
the loggers (:mod:`.loggers`, ``--logger``).

The engine imports neither the command line, the tasks nor the reports; the pipelines
(:mod:`dmscale.run.pipeline`) build on it.
"""

from dmscale.engine.device import COMPILE_BACKEND, PRECISIONS, Precision, compiled_forward, resolve_device, set_threads
from dmscale.engine.evaluation import BEST_FILE, PhaseWatch, offer_best, read_best
from dmscale.engine.loggers import JsonlLogger, RunLogger, TensorBoardLogger, make_logger
from dmscale.engine.loop import MAX_NON_FINITE_STEPS, LoopHost, StepLoop, StepOutput
from dmscale.engine.rundir import (
    CHECKPOINT_VERSION,
    Progress,
    RunDir,
    StopOnSignals,
    Stopped,
    atomic_write_text,
    fmt_count,
    fmt_time,
    read_checkpoint,
    rng_state,
    set_rng_state,
)

__all__ = [
    "BEST_FILE", "CHECKPOINT_VERSION", "COMPILE_BACKEND", "JsonlLogger", "LoopHost", "MAX_NON_FINITE_STEPS",
    "PRECISIONS", "PhaseWatch", "Precision", "Progress", "RunDir", "RunLogger", "StepLoop", "StepOutput",
    "StopOnSignals", "Stopped", "TensorBoardLogger", "atomic_write_text",
    "compiled_forward", "fmt_count", "fmt_time", "make_logger", "offer_best", "read_best", "read_checkpoint",
    "resolve_device", "rng_state", "set_rng_state", "set_threads",
]
