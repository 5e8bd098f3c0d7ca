"""FSDP2 check on GPUs: a DMS search of a Llama sharded over N GPUs (NCCL), the parts the CPU
tests (gloo, tests/engine/test_fsdp.py) cannot reach.

Run from the repository root on a node with 2 (or more) GPUs:

    torchrun --standalone --nproc_per_node 2 bench/fsdp_check.py --out OUT            # SmolLM2-135M's shape
    torchrun --standalone --nproc_per_node 2 bench/fsdp_check.py --out OUT --reference  # + one-GPU reference
    torchrun --standalone --nproc_per_node 2 bench/fsdp_check.py --quick --device cpu   # CPU smoke run (gloo)

What it does, on every rank: builds the same randomly initialised ``LlamaForCausalLM`` on the
CPU, ``dms.prepare`` on the CPU (the whole model never sits on one GPU), then
:func:`dmscale.engine.fsdp.shard_model`: each decoder layer and the root are ``fully_shard``-ed
onto ``cuda:LOCAL_RANK`` (FSDP2 moves only each rank's shard there), the gates replicated.
``--steps`` search steps under bf16 autocast on this rank's share of a global batch (SGD on the
weights, Adam on ``a``; ``handle.sync_grads()`` and ``searcher.sync_importance()`` after each
backward); then ``handle.export(searcher)`` (gathered to rank 0 on the CPU, verified against
the hardened gathered supernet).

Checks written to ``OUT/fsdp_check.json`` (rank 0): ``a``, importance and the structure are
bit-identical on every rank (all-gathered); the export verifies and its parameter count is
the searcher's hard cost; peak GPU memory per rank and the median step time. With
``--reference`` (models that fit on one GPU) rank 0 then repeats the same steps unsharded on
its GPU on the whole global batch: ``a`` and importance must match within ``--atol`` (tight
with ``--fp32``; under bf16 autocast the ranks' smaller batches round differently) and the
structure exactly. Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import dmscale as dms  # noqa: E402
from dmscale.core.distributed import shard  # noqa: E402
from dmscale.engine.fsdp import shard_model  # noqa: E402

SHAPES = {  # (hidden, ffn, layers, heads, kv_heads, vocab)
    "smollm2": (576, 1536, 30, 9, 3, 49152),
    "quick": (64, 128, 3, 4, 2, 128),
}


def build(shape: str) -> torch.nn.Module:
    dms.ensure_torchvision()
    import transformers

    hidden, ffn, layers, heads, kv, vocab = SHAPES[shape]
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
                                   num_hidden_layers=layers, num_attention_heads=heads,
                                   num_key_value_heads=kv, tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(cfg)


def batches(steps: int, batch: int, seq: int, vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (batch, seq), generator=g) for _ in range(steps)]


def search(args: argparse.Namespace, device: torch.device, rank: int, world: int,
           sharded: bool) -> tuple[dms.Searcher, Any, list[float]]:
    model = build(args.shape)
    vocab = model.config.vocab_size
    example = {"input_ids": torch.randint(0, vocab, (2, args.seq), generator=torch.Generator().manual_seed(5))}
    searcher = dms.prepare(model, example, dms.SearchConfig(resource="params", target=0.7, align=1))
    if sharded:
        handle = shard_model(model, space=searcher.space)
    else:  # the one-GPU reference on rank 0: importance from its own (whole) batch
        model.to(device)
        searcher.use_process_group(False)
        handle = None
    opt_w = torch.optim.SGD(list(searcher.model_parameters()), lr=1e-2)
    opt_a = torch.optim.Adam(list(searcher.structure_parameters()), lr=5e-2)
    model.train()
    times = []
    for step, ids in enumerate(batches(args.steps, args.batch, args.seq, vocab)):
        ids = (shard(ids, rank, world) if sharded else ids).to(device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=not args.fp32):
            loss = model(input_ids=ids, labels=ids).loss
        loss = loss + searcher.resource_loss((step + 1) / args.steps)
        opt_w.zero_grad(), opt_a.zero_grad()
        loss.backward()
        if handle is not None:
            handle.sync_grads()
        searcher.sync_importance()
        opt_w.step(), opt_a.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return searcher, handle, times


def gates_of(searcher: dms.Searcher) -> tuple[torch.Tensor, torch.Tensor]:
    gates = list(searcher.gates.width) + list(searcher.gates.depth)
    a = torch.stack([t.a.detach().float().reshape(()) for t in gates]).cpu()
    return a, torch.cat([t.importance.detach().float().reshape(-1) for t in gates]).cpu()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "bench" / "runs" / "fsdp_check"))
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--quick", action="store_true", help="a tiny Llama, 3 steps, batch 4 x 16")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--batch", type=int, default=None, help="global batch (default 8; quick: 4)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 512; quick: 16)")
    p.add_argument("--fp32", action="store_true", help="no bf16 autocast")
    p.add_argument("--reference", action="store_true", help="rank 0 repeats the search unsharded on one GPU")
    p.add_argument("--atol", type=float, default=None,
                   help="tolerance vs the reference: of a (absolute) and importance (relative to its largest value); "
                        "default 1e-5 with --fp32, 5e-2 under bf16 (other per-rank batch shapes round differently)")
    args = p.parse_args()
    args.shape = "quick" if args.quick else "smollm2"
    args.steps = args.steps or (3 if args.quick else 10)
    args.batch = args.batch or (4 if args.quick else 8)
    args.seq = args.seq or (16 if args.quick else 512)
    args.atol = args.atol if args.atol is not None else (1e-5 if args.fp32 else 5e-2)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda":
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device, timeout=timedelta(minutes=10))
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timedelta(minutes=10))
    rank, world = dist.get_rank(), dist.get_world_size()
    result: dict[str, Any] = {"world": world, "device": torch.cuda.get_device_name(device) if args.device == "cuda" else "cpu",
                              "torch": torch.__version__, "shape": args.shape, "steps": args.steps,
                              "batch": args.batch, "seq": args.seq, "bf16": not args.fp32, "checks": {}}
    try:
        searcher, handle, times = search(args, device, rank, world, sharded=True)
        a, imp = gates_of(searcher)
        width = [(d["name"], d["kept"]) for d in searcher.structure()["width"]]
        box: list[Any] = [None] * world
        dist.all_gather_object(box, (a, imp, width))
        checks = result["checks"]
        checks["a_identical"] = all(torch.equal(a, b[0]) for b in box)
        checks["importance_identical"] = all(torch.equal(imp, b[1]) for b in box)
        checks["structure_identical"] = all(width == b[2] for b in box)
        mem = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else 0.0
        mems: list[Any] = [None] * world
        dist.all_gather_object(mems, mem)
        result["peak_mib_per_rank"] = mems
        result["step_ms_median"] = 1000 * statistics.median(times[1:] or times)
        small = handle.export(searcher)  # verify=True: export == gathered, hardened supernet
        if small is not None:
            counted = dms.count(small, {"input_ids": torch.zeros(1, 8, dtype=torch.long)})["params"]
            checks["export_verified"] = True
            checks["export_params_is_hard_cost"] = counted == searcher.resources()["hard"]
        dist.barrier()
        if args.reference and rank == 0:
            torch.cuda.reset_peak_memory_stats(device) if device.type == "cuda" else None
            ref, _, _ = search(args, device, 0, 1, sharded=False)
            ra, rimp = gates_of(ref)
            result["a_max_abs_diff"] = float((a - ra).abs().max())
            result["importance_max_diff_rel"] = float((imp - rimp).abs().max() / rimp.abs().max().clamp_min(1e-30))
            checks["a_matches_one_gpu"] = result["a_max_abs_diff"] <= args.atol
            checks["importance_matches_one_gpu"] = result["importance_max_diff_rel"] <= args.atol
            checks["structure_matches_one_gpu"] = width == [(d["name"], d["kept"]) for d in ref.structure()["width"]]
            result["reference_peak_mib"] = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else 0.0
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return 0
    ok = all(result["checks"].values())
    result["ok"] = ok
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fsdp_check.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
