"""The step loop (dmscale.engine): mixed precision, gradient scaling, torch.compile, the
device cache of the cost model.

* ``--precision bf16``: search steps run under autocast (the logits are bfloat16), the
  structural parameters and importance stay float32, importance is finite and non-zero; a
  bf16 run stopped and resumed equals the uninterrupted one; --precision cannot change on
  resume;
* ``--precision fp16``: an overflowing step (gradients made infinite by a huge loss scale)
  changes no weight, no structural parameter and no importance buffer, and lowers the scale;
  the scaler's state is in the checkpoint;
* ``--compile``: a search under torch.compile (backend aot_eager here: no C++ build) equals
  the eager one; a compiler that fails is a one-line error that says to run without it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import dmscale.engine.device as device_mod
from dmscale.config.run_config import ConfigError, RunConfig
from dmscale.engine import Precision, StepLoop
from dmscale.run.pipeline import Pipeline, searcher_from_checkpoint
from dmscale.run.saved_runs import new_supernet

TINY = dict(task="digits", model="smallcnn", model_args={"width": 4, "blocks": 2}, train_limit=128,
            test_limit=64, batch_size=64, threads=1, quiet=True, structure_lr=0.05)


def _cfg(out: Path, **kw: Any) -> RunConfig:
    return RunConfig(**{**TINY, "out": str(out), "retrain_epochs": 0, **kw})  # type: ignore[arg-type]


def _gate_tensors(searcher: Any) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in [*searcher.gates.named_parameters(), *searcher.gates.named_buffers()]
            if t.is_floating_point()}


# ----------------------------------------------------------------------------- bf16
def test_bf16_search_autocasts_the_forward_and_keeps_the_structure_float32(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from dmscale.tasks.registry import Task

    seen: list[torch.dtype] = []
    real = Task.task_loss

    def task_loss(self: Task, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        seen.append(logits.dtype)
        return real(self, logits, targets)

    monkeypatch.setattr(Task, "task_loss", task_loss)
    run = tmp_path / "r"
    with pytest.raises(Exception) as stop:
        Pipeline(_cfg(run, precision="bf16", epochs=2, stop_after=3, checkpoint_every=1)).run()
    assert type(stop.value).__name__ == "Stopped"
    assert seen and set(seen) == {torch.bfloat16}
    model, searcher, cfg, step = searcher_from_checkpoint(run)
    assert cfg.precision == "bf16" and step == 3
    gates = _gate_tensors(searcher)
    assert gates and all(t.dtype == torch.float32 for t in gates.values())
    importance = [t for n, t in gates.items() if n.endswith("importance")]
    assert importance and all(torch.isfinite(t).all() for t in importance)
    assert any(bool((t > 0).any()) for t in importance), "no importance was accumulated"
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert "scaler" not in torch.load(run / "checkpoint.pt", weights_only=False)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_resumed_mixed_precision_run_equals_the_uninterrupted_one(precision: str, tmp_path: Path) -> None:
    kw = dict(precision=precision, epochs=2, checkpoint_every=1)
    Pipeline(_cfg(tmp_path / "full", **kw)).run()
    with pytest.raises(Exception):
        Pipeline(_cfg(tmp_path / "cut", stop_after=2, **kw)).run()
    if precision == "fp16":
        ck = torch.load(tmp_path / "cut" / "checkpoint.pt", weights_only=False)
        assert ck["scaler"]["scale"] > 0
    with pytest.raises(ConfigError, match="--precision"):
        Pipeline(_cfg(tmp_path / "cut", precision="32"), resume=True, explicit={"precision"})
    Pipeline(_cfg(tmp_path / "cut", **kw), resume=True).run()
    for name in ("model.safetensors", "structure.json"):
        assert (tmp_path / "full" / name).read_bytes() == (tmp_path / "cut" / name).read_bytes(), name


def test_precision_is_validated() -> None:
    with pytest.raises(ConfigError, match="--precision"):
        RunConfig(precision="fp8")
    with pytest.raises(ConfigError, match="--precision"):
        Precision("int8", torch.device("cpu"))
    assert Precision("fp16", torch.device("cpu")).scaler.is_enabled()


# ----------------------------------------------------------------------------- fp16 overflow
def _search_loop(tmp_path: Path, precision: str) -> tuple[Pipeline, StepLoop]:
    pipe = Pipeline(_cfg(tmp_path / "r", precision=precision))
    pipe.ctx.rd.path.mkdir(parents=True)
    model, exclude = new_supernet(pipe.ctx.cfg, pipe.ctx.task.info, 0)
    searcher = pipe.make_searcher(model, exclude)
    w_opt = torch.optim.SGD(list(searcher.model_parameters()), lr=0.1, momentum=0.9)
    s_opt = torch.optim.Adam(list(searcher.structure_parameters()), lr=0.05)
    loop = StepLoop(pipe.ctx, "search", model, 1, [w_opt, s_opt], searcher=searcher, seed=1)
    return pipe, loop


def test_an_fp16_overflow_skips_every_optimizer_and_keeps_importance(tmp_path: Path) -> None:
    pipe, loop = _search_loop(tmp_path, "fp16")
    pipe.ctx.precision.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40)  # grads overflow in fp16
    weights = {n: p.detach().clone() for n, p in loop.model.named_parameters()}
    gates = _gate_tensors(loop.searcher)
    loop.run()
    assert pipe.ctx.precision.scaler.get_scale() == 2.0 ** 39  # backed off
    assert all(torch.equal(p, weights[n]) for n, p in loop.model.named_parameters())  # a included
    assert all(torch.equal(t, gates[n]) for n, t in _gate_tensors(loop.searcher).items())
    events = [json.loads(line) for line in pipe.ctx.rd.metrics.read_text().splitlines()]
    assert [e["event"] for e in events if "event" in e] == ["grad_overflow"]
    # at a sane scale the same step changes weights, structure and importance
    pipe.ctx.precision.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    loop.run()
    assert pipe.ctx.precision.scaler.get_scale() == 2.0 ** 8
    assert not torch.equal(loop.searcher.gates.width_ratios, gates["width_ratios"])
    imp = [t for n, t in _gate_tensors(loop.searcher).items() if n.endswith("importance")]
    assert all(torch.isfinite(t).all() for t in imp) and any(bool((t > 0).any()) for t in imp)
    assert any(not torch.equal(p, weights[n]) for n, p in loop.model.named_parameters() if "dms_gates" not in n)


# ----------------------------------------------------------------------------- compile
def test_a_compiled_search_equals_the_eager_one(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from torch._dynamo.utils import counters

    monkeypatch.setattr(device_mod, "COMPILE_BACKEND", "aot_eager")
    runs = {}
    torch._dynamo.reset()
    counters.clear()
    try:
        for compiled in (False, True):
            pipe, loop = _search_loop(tmp_path / str(compiled), "32")
            pipe.ctx.cfg.compile = compiled
            loop.total = 2
            torch.manual_seed(0)
            loop.run()
            assert "forward" not in vars(loop.model)  # the class's forward again after the phase
            runs[compiled] = _gate_tensors(loop.searcher)
        graphs, breaks = counters["stats"]["unique_graphs"], dict(counters["graph_break"])
    finally:
        torch._dynamo.reset()
    assert graphs >= 1 and not breaks, (graphs, breaks)  # compiled whole, the mask hooks included
    assert runs[False].keys() == runs[True].keys()
    for name, t in runs[False].items():
        torch.testing.assert_close(runs[True][name], t, rtol=1e-5, atol=1e-7, msg=name)
    assert any(bool((t > 0).any()) for n, t in runs[True].items() if n.endswith("importance"))


def test_a_failing_compiler_is_a_config_error_and_leaves_no_run(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    def broken(gm: Any, example_inputs: Any) -> Any:
        raise RuntimeError("no C++ compiler here")

    monkeypatch.setattr(device_mod, "COMPILE_BACKEND", broken)
    try:
        with pytest.raises(ConfigError, match="run without --compile") as err:
            Pipeline(_cfg(tmp_path / "r", compile=True, epochs=1)).run()
    finally:
        torch._dynamo.reset()
    assert "no C++ compiler here" in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "r").exists()


def test_compile_and_precision_on_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dmscale.cli import main

    text = ""
    try:
        main(["search", "--help"])
    except SystemExit:
        text = capsys.readouterr().out
    assert "--precision {32,bf16,fp16}" in text and "--compile" in text


# ----------------------------------------------------------------------------- cost model
def test_the_cost_model_moves_its_index_tensors_once(tmp_path: Path) -> None:
    _, loop = _search_loop(tmp_path, "32")
    before = float(loop.searcher.costs.soft().detach())
    cost = loop.searcher.costs.models["macs"]
    first = cost.on(torch.device("cpu"), cost._seg, cost.terms.base)
    again = cost.on(torch.device("cpu"), cost._seg, cost.terms.base)
    assert all(a is b for a, b in zip(first, again))
    assert float(loop.searcher.costs.soft().detach()) == before


# ----------------------------------------------------------------------------- devices
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_cuda_without_cuda_is_a_config_error(tmp_path: Path) -> None:
    from dmscale.engine import resolve_device

    with pytest.raises(ConfigError, match="--device cuda: no CUDA device is available.*--device cpu"):
        resolve_device("cuda")
    with pytest.raises(ConfigError, match="--device cuda"):
        Pipeline(_cfg(tmp_path / "r", device="cuda", precision="fp16")).run()
    assert resolve_device("auto").type == "cpu"


def test_autocast_and_scaler_follow_the_device() -> None:
    p = Precision("fp16", torch.device("cpu"))
    assert p.scaler._device == "cpu"
    with p.autocast():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.float16
    assert Precision("32", torch.device("cpu")).state_dict() is None


def test_device_cuda_n_is_accepted_and_checked():
    from dmscale.core.values import device_value

    assert device_value("cuda:3") == "cuda:3"
    with pytest.raises(ConfigError, match=r"cuda:N"):
        device_value("gpu1")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"--device cuda:1: no CUDA device"):
            device_mod.resolve_device("cuda:1")


def test_export_takes_no_device_or_thread_options(capsys):
    """export ran on the CPU whatever --device said: the options are gone, not ignored."""
    from dmscale.cli import main

    for flag in ("--device", "--threads"):
        with pytest.raises(SystemExit):
            main(["export", "runs/x", flag, "1"])
        assert f"unrecognized arguments: {flag}" in capsys.readouterr().err
