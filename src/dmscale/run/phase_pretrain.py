"""The pretrain phase: train the supernet's weights (pipelines p / p- before their search, or
the ``dmscale pretrain`` command), then write ``supernet.safetensors`` (and for ``dmscale
pretrain`` its ``model.safetensors``)."""

from __future__ import annotations

from dmscale.engine.fsdp import unsharded
from dmscale.run.context import PhaseResult, RunContext
from dmscale.run.model_checks import check_hf
from dmscale.run.saved_runs import new_supernet
from dmscale.run.supernets import evaluate_original, record_supernet, start_weights
from dmscale.run.training import cosine_schedule, shard, train, weight_optimizer

__all__ = ["PretrainPhase"]


class PretrainPhase:
    """Train a new supernet (``--weights`` / ``--pretrained`` loaded first) for
    ``--pretrain-epochs`` (``--epochs`` of ``dmscale pretrain``)."""

    name = "pretrain"

    def run(self, ctx: RunContext) -> PhaseResult:
        cfg = ctx.cfg
        model, _ = new_supernet(cfg, ctx.task.info, cfg.seed)
        if ctx.checkpoint_for("pretrain") is None:
            evaluate_original(ctx, model)  # an hf: model as loaded, before --weights
            start_weights(ctx, model)
        check_hf(cfg, model)
        model.to(ctx.device)
        record_supernet(ctx, model)
        shard(cfg, model)
        total = ctx.steps(cfg.epochs if cfg.command == "pretrain" else cfg.pretrain_epochs)
        opt = weight_optimizer(cfg, list(model.parameters()))
        train(ctx, "pretrain", model, total, [opt], [cosine_schedule(cfg, opt, total)])
        metrics = ctx.watch.phase_result(ctx, "pretrain", model, total, ctx.evaluate("pretrain", model, None, total))
        ctx.state["evals"]["pretrain"] = metrics
        full = unsharded(model)  # --shard fsdp: gathered on rank 0, None on the other ranks
        wrote = ["supernet.safetensors"]
        ctx.save_weights(full, "supernet.safetensors")
        if cfg.command == "pretrain":
            ctx.save_weights(full, "model.safetensors")
            ctx.state["counts"]["found"] = ctx.state["counts"]["supernet"]
            wrote.append("model.safetensors")
        return PhaseResult(wrote=wrote, metrics=metrics)
