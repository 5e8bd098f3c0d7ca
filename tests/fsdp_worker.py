"""A DMS search of a tiny Llama run by one rank of an FSDP2 job (or by one process on the
whole batch), for ``tests/engine/test_fsdp.py``: two spawned CPU processes (gloo) each call
:func:`worker`; the test compares what they save with :func:`search` in one process.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import dmscale as dms
from dmscale.core.distributed import shard
from dmscale.engine.fsdp import shard_model
from torchrun_util import leaving_process_group

__all__ = ["BATCH", "STEPS", "VOCAB", "build", "probe_ids", "search", "search_record", "worker"]

STEPS, BATCH, VOCAB, SEQ = 3, 4, 64, 8


def build(layers: int = 3) -> nn.Module:
    """The same tiny Llama (tied embeddings, grouped KV heads) in every process."""
    dms.ensure_torchvision()
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=layers, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(config)


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(STEPS)]


def probe_ids() -> torch.Tensor:
    """Token ids the exports are compared on."""
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(7))


def _prepared(fold: bool) -> tuple[nn.Module, dms.Searcher]:
    model = build()
    example = {"input_ids": torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))}
    return model, dms.prepare(model, example, dms.SearchConfig(resource="params", target=0.6, fold_masks=fold))


def search_record(searcher: Any) -> dict[str, Any]:
    """What the ranks must agree on after a search: the ratios ``a``, the importances and the
    kept widths and depths."""
    gates = list(searcher.gates.width) + list(searcher.gates.depth)
    structure = searcher.structure()
    return {"a": torch.stack([t.a.detach().clone() for t in gates]).cpu(),
            "importance": [t.importance.detach().clone().cpu() for t in gates],
            "width": [(d["name"], d["kept"]) for d in structure["width"]],
            "depth": [(d["name"], d["kept"]) for d in structure["depth"]]}

def search(fold: bool = True, rank: int = 0, world: int = 1, out_dir: str | None = None) -> dict[str, Any]:
    """``STEPS`` search steps, sharded with FSDP2 when ``world > 1`` (each rank on its shard
    of the global batch), then the export (on rank 0); with ``out_dir`` rank 0 saves the
    export with ``save_pretrained`` there."""
    model, searcher = _prepared(fold)
    handle = shard_model(model, space=searcher.space)
    opt_w = torch.optim.SGD(list(searcher.model_parameters()), lr=0.1)
    opt_a = torch.optim.Adam(list(searcher.structure_parameters()), lr=5e-2)
    model.train()
    for step, ids in enumerate(_batches()):
        ids = shard(ids, rank, world)
        loss = model(input_ids=ids, labels=ids).loss + searcher.resource_loss((step + 1) / STEPS)
        opt_w.zero_grad(), opt_a.zero_grad()
        loss.backward()
        handle.sync_grads()
        searcher.sync_importance()
        opt_w.step(), opt_a.step()
    result: dict[str, Any] = {
        **search_record(searcher),
        "blocks": list(handle.plan.blocks), "active": handle.active,
        "sharded_types": sorted({type(p).__name__ for p in searcher.model_parameters()}),
    }
    state = handle.state_dict()
    small = handle.export(searcher)  # verified against the gathered, hardened supernet
    if small is not None:
        result["state"] = {k: v.detach().clone() for k, v in state.items()}
        with torch.no_grad():
            result["export_logits"] = small.eval()(input_ids=probe_ids()).logits
        result["export_shapes"] = {n: tuple(p.shape) for n, p in small.named_parameters()}
        result["hard"] = searcher.resources()["hard"]
        result["counted"] = dms.count(small, {"input_ids": probe_ids()})["params"]
        if out_dir is not None:
            dms.save_pretrained(small, os.path.join(out_dir, "hf"))
    if world > 1:
        result["resumed"] = _resume_round_trip(handle, searcher, opt_w, fold)
    return result


def _resume_round_trip(handle: Any, searcher: dms.Searcher, opt: torch.optim.Optimizer, fold: bool) -> bool:
    """The full model and optimizer state gathered to rank 0, loaded (on every rank) into a
    fresh sharded copy: both take the same next step."""
    from dmscale.engine.fsdp import load_model_state, load_optimizer_state, model_state, optimizer_state

    box = [(model_state(handle.model), optimizer_state(handle.model, opt), searcher.state_dict())]
    dist.broadcast_object_list(box, src=0)  # what every rank reads from the checkpoint file
    model_sd, opt_sd, search_sd = box[0]
    model, again = _prepared(fold)
    shard_model(model, space=again.space)
    opt2 = torch.optim.SGD(list(again.model_parameters()), lr=0.1)
    load_model_state(model, model_sd)
    load_optimizer_state(model, opt2, opt_sd)
    again.load_state_dict(search_sd)
    ids = shard(_batches()[0], dist.get_rank(), dist.get_world_size())
    losses = []
    for net, s, o in ((handle.model, searcher, opt), (model, again, opt2)):
        loss = net(input_ids=ids, labels=ids).loss
        o.zero_grad()
        loss.backward()
        s.sync_importance()
        o.step()
        losses.append(net(input_ids=ids, labels=ids).loss.detach())
    return bool(torch.allclose(losses[0], losses[1], rtol=1e-5, atol=1e-6))


def worker(rank: int, world: int, init_file: str, out_dir: str, cases: tuple[str, ...] = ("fold",)) -> None:
    """Entry point of one spawned rank: the ``cases`` (``fold``: masks folded into the
    weights, the default; ``activations``: on the activations), results saved to
    ``out_dir/rank{r}.pt``."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    with leaving_process_group():
        results = {case: search(case == "fold", rank, world, out_dir if case == "fold" else None)
                   for case in cases}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
