"""Public namespace ``dmscale.distributed``: the process-group helpers a multi-GPU search
uses (world size, rank, sharding a dataset, the mean all-reduce). The code lives in
:mod:`dmscale.core.distributed`; this module re-exports it.

Example:
    >>> import dmscale as dms
    >>> dms.distributed.world_size()
    1
"""

from dmscale.core.distributed import all_reduce_mean, is_distributed, is_main_process, rank, shard, world_size

__all__ = ["world_size", "rank", "is_main_process", "is_distributed", "shard", "all_reduce_mean"]
