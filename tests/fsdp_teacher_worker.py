"""One rank of an FSDP2 job that distils a tiny Llama search from a frozen teacher, for
``tests/engine/test_fsdp_teacher.py``: the teacher whole on every rank or sharded
(:func:`dmscale.engine.fsdp.shard_frozen`), the student's weights gathered in float32 or, under
bf16 autocast, in bfloat16 (``shard_model(param_dtype=torch.bfloat16)``).
"""

from __future__ import annotations

import contextlib
import copy
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import dmscale as dms
from dmscale.core.distributed import shard
from dmscale.engine.fsdp import shard_frozen, shard_model
from dmscale.tasks.distill import distill_loss
from fsdp_worker import SEQ, STEPS, VOCAB, build, probe_ids, search_record
from torchrun_util import leaving_process_group

__all__ = ["distilled_search", "teacher", "worker"]

BATCH = 4


def teacher() -> nn.Module:
    """A frozen tiny Llama (another seed than the student), as ``load_teacher`` leaves it."""
    torch.manual_seed(11)
    net = build()
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.02 * torch.randn_like(p))
    net.eval()
    for p in net.parameters():
        p.requires_grad_(False)
    return net


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(STEPS)]


def _logits(net: nn.Module, autocast: bool) -> torch.Tensor:
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with torch.no_grad(), ctx:
        return net(input_ids=probe_ids()).logits.float()


def teacher_logits() -> dict[str, Any]:
    """The teacher's logits whole and sharded (float32; bfloat16 under autocast), on every rank."""
    out: dict[str, Any] = {}
    for name, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
        net = teacher()
        whole = copy.deepcopy(net)
        if dtype is not None:  # what shard_frozen stores: the parameters in bfloat16, the buffers kept
            for p in whole.parameters():
                p.data = p.data.to(dtype)
        handle = shard_frozen(net, param_dtype=dtype)
        out[name] = {"whole": _logits(whole, dtype is not None), "sharded": _logits(net, dtype is not None),
                     "active": handle.active, "param_dtype": handle.param_dtype,
                     "local": sum(p.to_local().numel() for p in net.parameters()),
                     "total": sum(p.numel() for p in whole.parameters()),
                     "dtypes": sorted({str(p.dtype) for p in net.parameters()})}
    return out


def distilled_search(rank: int, world: int, shard_teacher: bool, precision: str = "32",
                     param_dtype: torch.dtype | None = None) -> dict[str, Any]:
    """``STEPS`` search steps of the student, sharded, with the KL to the teacher added."""
    model = build()
    example = {"input_ids": torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))}
    searcher = dms.prepare(model, example, dms.SearchConfig(resource="params", target=0.6))
    handle = shard_model(model, space=searcher.space, param_dtype=param_dtype)
    net = teacher()
    t_dtype = torch.bfloat16 if precision == "bf16" else None
    if shard_teacher:
        shard_frozen(net, param_dtype=t_dtype)
    opt_w = torch.optim.SGD(list(searcher.model_parameters()), lr=0.1)
    opt_a = torch.optim.Adam(list(searcher.structure_parameters()), lr=5e-2)
    model.train()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
    for step, ids in enumerate(_batches()):
        ids = shard(ids, rank, world)
        with autocast:
            out = model(input_ids=ids, labels=ids)
            with torch.no_grad():
                t_logits = net(input_ids=ids).logits
            loss = out.loss + distill_loss(out.logits, t_logits, 1.0)
        loss = loss + searcher.resource_loss((step + 1) / STEPS)
        opt_w.zero_grad(), opt_a.zero_grad()
        loss.backward()
        handle.sync_grads()
        searcher.sync_importance()
        opt_w.step(), opt_a.step()
    record = search_record(searcher)
    state = handle.state_dict()
    return {**record, "param_dtype": handle.param_dtype, "loss": float(loss),
            "state": {k: v.detach().clone() for k, v in state.items()}}


CASES = {
    "teacher_logits": lambda rank, world: teacher_logits(),
    "whole_teacher": lambda rank, world: distilled_search(rank, world, False),
    "sharded_teacher": lambda rank, world: distilled_search(rank, world, True),
    "bf16_fp32_params": lambda rank, world: distilled_search(rank, world, True, "bf16", None),
    "bf16_params": lambda rank, world: distilled_search(rank, world, True, "bf16", torch.bfloat16),
}


def worker(rank: int, world: int, init_file: str, out_dir: str, cases: tuple[str, ...]) -> None:
    """Entry point of one spawned rank: the named ``cases``, saved to ``out_dir/rank{r}.pt``."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    with leaving_process_group():
        torch.save({case: CASES[case](rank, world) for case in cases}, os.path.join(out_dir, f"rank{rank}.pt"))
