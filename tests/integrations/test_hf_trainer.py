"""DMS inside transformers.Trainer (dmscale.integrations.hf_trainer): a tiny Llama, ~10 steps."""

from __future__ import annotations

import pytest
import torch

import dmscale as dms

dms.ensure_torchvision()
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from dmscale.integrations.hf_trainer import DMSTrainer  # noqa: E402

VOCAB = 100


def tiny_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config)


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 64, length: int = 16) -> None:
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, VOCAB, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class GroupProbe(transformers.TrainerCallback):
    """Records the structural group's lr and weight decay right before each optimizer step."""

    def __init__(self) -> None:
        self.seen: list[tuple[float, float]] = []

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        group = next(g for g in optimizer.param_groups if g.get("dms_structure"))
        self.seen.append((group["lr"], group["weight_decay"]))


def _args(tmp_path, **kw) -> transformers.TrainingArguments:
    base = dict(output_dir=str(tmp_path / "run"), max_steps=10, per_device_train_batch_size=4,
                learning_rate=1e-3, weight_decay=0.1, lr_scheduler_type="linear", report_to=[],
                save_strategy="no", logging_steps=5, use_cpu=True, disable_tqdm=True, seed=0)
    base.update(kw)
    return transformers.TrainingArguments(**base)


def test_dms_trainer_searches_exports_and_saves(tmp_path, monkeypatch):
    # the factor of the settle phase reaches the user's optimizer (stubbed: 1, then 0.5 from half-way)
    monkeypatch.setattr(dms.Searcher, "structure_lr_scale", lambda self, p: 1.0 if p < 0.5 else 0.5)
    model = tiny_llama()
    example = {"input_ids": torch.randint(0, VOCAB, (1, 16))}
    probe = GroupProbe()
    trainer = DMSTrainer(
        model=model, args=_args(tmp_path, gradient_accumulation_steps=2), train_dataset=RandomTokens(),
        callbacks=[probe],
        search_config=dms.SearchConfig(resource="params", target=0.6, layer_uniform=True, search_depth=False,
                                       exclude=["model.embed_tokens"]),
        example_inputs=example, structure_lr=0.05, export_dir=tmp_path / "found")
    searcher = trainer.searcher
    a0 = [p.detach().clone() for p in searcher.structure_parameters()]
    soft0 = searcher.resources()["soft"]
    trainer.train()

    # own group, own lr (times the settle phase's factor) (the linear schedule drives the weights only), no weight decay
    assert probe.seen == [(0.05, 0.0)] * 5 + [(0.025, 0.0)] * 5  # x structure_lr_scale (stubbed below)
    ids = {id(p) for p in searcher.structure_parameters()}
    others = [p for g in trainer.optimizer.param_groups if not g.get("dms_structure") for p in g["params"]]
    assert not ids & {id(p) for p in others}
    # the structural parameters moved, and the resource loss pulled the cost toward the target
    moved = [float((p.detach() - a).abs().max()) for p, a in zip(searcher.structure_parameters(), a0)]
    assert max(moved) > 0.1
    logged = [h for h in trainer.state.log_history if "dms_cost_soft" in h]
    assert logged and logged[-1]["dms_cost_soft"] < 0.9 and logged[0]["dms_resource_loss"] > 0
    assert searcher.resources()["soft"] < 0.9 * soft0
    # the export is physically smaller, within the budget, and loads with from_pretrained
    small = trainer.found_model
    n_small, n_super = sum(p.numel() for p in small.parameters()), sum(p.numel() for p in model.parameters())
    assert n_small < 0.75 * n_super
    assert dms.count(small, example)["params"] <= searcher.target_cost
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "found")
    x = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():
        small.eval(), loaded.eval()
        torch.testing.assert_close(loaded(input_ids=x).logits, small(input_ids=x).logits, rtol=0, atol=1e-5)


def test_dms_trainer_takes_a_searcher_and_names_wrong_use(tmp_path):
    model = tiny_llama()
    example = {"input_ids": torch.randint(0, VOCAB, (1, 8))}
    with pytest.raises(ValueError, match="search_config=dms.SearchConfig"):
        DMSTrainer(model=model, args=_args(tmp_path), train_dataset=RandomTokens())
    other = tiny_llama()
    searcher = dms.prepare(other, example, dms.SearchConfig(resource="params", target=0.5))
    with pytest.raises(ValueError, match="not part of the trained"):
        DMSTrainer(model=model, args=_args(tmp_path), train_dataset=RandomTokens(), searcher=searcher)
    dms.detach(other)
    searcher = dms.prepare(model, example, dms.SearchConfig(resource="params", target=0.5))
    trainer = DMSTrainer(model=model, args=_args(tmp_path, max_steps=2), train_dataset=RandomTokens(),
                         searcher=searcher)
    trainer.train()
    assert trainer.found_model is not None  # export_dir=None: exported, nothing written
    assert not (tmp_path / "found").exists()


def run_torchrun(script: str, *argv: str, timeout: float = 240) -> tuple[int, str]:
    """``torchrun --nproc_per_node 2 <script in this folder> argv...`` on CPU: (returncode, stderr)."""
    import os
    import sys
    from pathlib import Path

    from torchrun_util import run_group

    here = Path(__file__).resolve().parent
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(dms.__file__).parents[1]), str(here.parent),
                                          os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(here / script), *argv]
    done = run_group(cmd, env=env, timeout=timeout)  # (a hang fails with every process's stacks)
    return done.returncode, done.stderr


@pytest.mark.slow  # two processes importing transformers: about 40 s on 2 cores
@pytest.mark.parametrize("variant", ["width", "depth-checkpointing"])
def test_dms_trainer_under_torchrun_ddp_on_cpu(tmp_path, variant):
    """torchrun --nproc_per_node 2, gloo on CPU: DDP wraps the model, the structural ratios stay
    equal on both ranks (their gradients are all-reduced, the resource term is the same on each),
    rank 0 saves the export. Equal *structures* also need equal importance on both ranks:
    Searcher.sync_importance, called once per optimizer step.

    "depth-checkpointing" searches depth and freezes it half-way, with activation checkpointing,
    for which the Trainer builds DDP without find_unused_parameters: DMSTrainer turns it on
    (before, the step after the freeze failed with "Expected to mark a variable ready only once")."""
    import json

    rc, err = run_torchrun("hf_ddp_script.py", str(tmp_path), variant)
    assert rc == 0, err[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world"] for r in ranks] == [2, 2] and ranks[0]["wrapped"] == "DistributedDataParallel"
    assert ranks[0]["a"] == ranks[1]["a"] and ranks[0]["soft"] < 0.9
    assert (tmp_path / "found" / "model.safetensors").is_file()
    assert ranks[0]["has_sync"]
    assert ranks[0]["structure"] == ranks[1]["structure"]
    assert ranks[0]["depth_frozen"] is (variant != "width")
    if variant != "width":
        assert ranks[0]["find_unused"] is True


@pytest.mark.slow  # two processes importing transformers: about 30 s on 2 cores
def test_dms_trainer_refuses_ddp_without_find_unused_when_depth_freezes(tmp_path):
    rc, err = run_torchrun("hf_ddp_script.py", str(tmp_path), "depth-no-unused")
    assert rc != 0 and "ddp_find_unused_parameters=True" in err and "freezes depth" in err, err[-3000:]


def test_ddp_settings_for_a_depth_freeze_under_torchrun(tmp_path):
    """Under DDP (world size > 1): static_graph is refused with the fix; the TrainingArguments
    are found wherever a Trainer subclass takes them."""
    from types import SimpleNamespace

    from dmscale.integrations import hf_trainer as ht

    example = {"input_ids": torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(0))}
    searcher = dms.prepare(tiny_llama(), example, dms.SearchConfig(resource="params", target=0.6))

    def args(**kw):
        return SimpleNamespace(**{"ddp_find_unused_parameters": None, "world_size": 2, **kw})

    with pytest.raises(ValueError, match=r"static_graph=True .*ddp_static_graph=False"):
        ht._let_ddp_find_unused(args(ddp_static_graph=True), searcher)
    both = args()
    ht._let_ddp_find_unused(both, searcher)
    assert both.ddp_find_unused_parameters is True
    single = args(world_size=1, ddp_static_graph=True, ddp_find_unused_parameters=False)
    ht._let_ddp_find_unused(single, searcher)  # one process: no DDP, nothing refused or changed
    assert single.ddp_find_unused_parameters is False
    found = args()
    assert ht._training_args(("model", "ref_model", found), {}) is found  # e.g. TRL's DPOTrainer
    assert ht._training_args((), {"args": found}) is found and ht._training_args(("model",), {}) is None


def test_activation_checkpointing_is_the_non_reentrant_kind(tmp_path):
    """Reentrant checkpointing recomputes a layer with the first forward's masks, whose graph the
    backward freed: the search failed with "Trying to backward through the graph a second time"
    (transformers 4.46 by default, 5.24 when asked for). Asked for, it is refused with the fix,
    the model left as it came; kwargs without use_reentrant become non-reentrant; transformers
    5's default trains."""
    from types import SimpleNamespace

    from dmscale.integrations import hf_trainer as ht

    example = {"input_ids": torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(0))}
    config = dms.SearchConfig(resource="params", target=0.6)
    model = tiny_llama()
    with pytest.raises(ValueError, match=r"reentrant .*\{'use_reentrant': False\}"):
        DMSTrainer(model=model, args=_args(tmp_path, gradient_checkpointing=True,
                                           gradient_checkpointing_kwargs={"use_reentrant": True}),
                   train_dataset=RandomTokens(), example_inputs=example, search_config=config)
    assert not hasattr(model, "dms_gates")
    trainer = DMSTrainer(model=model, args=_args(tmp_path, max_steps=3, gradient_checkpointing=True),
                         train_dataset=RandomTokens(), example_inputs=example, search_config=config)
    trainer.train()
    assert trainer.model.is_gradient_checkpointing and trainer.found_model is not None
    v5 = SimpleNamespace(activation_checkpointing=True, activation_checkpointing_kwargs={"preserve_rng_state": True},
                         gradient_checkpointing_kwargs=None)
    ht._non_reentrant_checkpointing(v5)
    assert v5.activation_checkpointing_kwargs == {"preserve_rng_state": True, "use_reentrant": False}
    assert v5.gradient_checkpointing_kwargs is None  # transformers 5's own default is non-reentrant


def test_dms_trainer_refusal_leaves_the_model_as_it_came(tmp_path, monkeypatch):
    from dmscale.integrations import hf_trainer as ht

    def refuse(args, searcher):
        raise ValueError("refused")

    monkeypatch.setattr(ht, "_let_ddp_find_unused", refuse)
    model = tiny_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    example = {"input_ids": torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(0))}
    with pytest.raises(ValueError, match="refused"):
        DMSTrainer(model=model, args=_args(tmp_path), train_dataset=RandomTokens(), example_inputs=example,
                   search_config=dms.SearchConfig(resource="params", target=0.6))
    assert not hasattr(model, "dms_gates") and model.state_dict().keys() == before.keys()
    dms.prepare(model, example, dms.SearchConfig(resource="params", target=0.6))  # can be searched again


def test_dms_trainer_lets_ddp_find_unused_parameters_when_depth_freezes(tmp_path):
    """The decision is made before the Trainer builds its accelerator: None (the Trainer's
    choice) becomes True when the search freezes depth part-way; left alone otherwise."""
    example = {"input_ids": torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(0))}

    def args_after(**search) -> transformers.TrainingArguments:
        args = _args(tmp_path)
        DMSTrainer(model=tiny_llama(), args=args, train_dataset=RandomTokens(), example_inputs=example,
                   search_config=dms.SearchConfig(resource="params", target=0.6, **search))
        return args

    assert args_after().ddp_find_unused_parameters is True  # depth searched, settle phase on
    assert args_after(settle=0.0, width_only_from=0.5).ddp_find_unused_parameters is True
    assert args_after(settle=0.0).ddp_find_unused_parameters is None  # depth never freezes
    assert args_after(search_depth=False).ddp_find_unused_parameters is None


def test_dms_trainer_checkpoints_and_resumes(tmp_path):
    """Checkpoints save (layer-uniform ratios are shared tensors, which save_pretrained refuses
    in a state dict) and resume_from_checkpoint restores the search: the resumed run ends
    where the uninterrupted one did."""
    def run(resume=None):
        trainer = DMSTrainer(
            model=tiny_llama(), train_dataset=RandomTokens(),
            args=_args(tmp_path, max_steps=4, save_strategy="steps", save_steps=2),
            search_config=dms.SearchConfig(resource="params", target=0.6, layer_uniform=True, search_depth=False,
                                           exclude=["model.embed_tokens"]),
            example_inputs={"input_ids": torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(0))},
            structure_lr=0.05)
        trainer.train(resume_from_checkpoint=resume)
        return torch.cat([p.detach().reshape(-1) for p in trainer.searcher.structure_parameters()])

    whole = run()
    checkpoint = tmp_path / "run" / "checkpoint-2"
    assert (checkpoint / "dms_search.pt").is_file()
    torch.testing.assert_close(run(resume=str(checkpoint)), whole)
