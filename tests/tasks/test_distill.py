"""Distillation with a pruned hidden size (src/dmscale/tasks/distill.py): the export's hidden
states are the hardened supernet's at the kept channels, which the structure records as the
input embedding's ``"out"``; the loss compares the teacher's states at those channels."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dmscale as dms
from dmscale.tasks.distill import Distillation, hidden_distill_loss, kept_hidden_channels
from dmscale.tasks.registry import Task

dms.ensure_torchvision()
transformers = pytest.importorskip("transformers")

HIDDEN = 32


def _tiny_lm(tie: bool) -> nn.Module:
    from dmscale.tasks.language import CausalLM

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=48, hidden_size=HIDDEN, intermediate_size=64,
                                   num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=8, tie_word_embeddings=tie)
    return CausalLM(transformers.LlamaForCausalLM(cfg))


def _searched(tie: bool, depth: bool) -> tuple[nn.Module, dms.Searcher, torch.Tensor]:
    """A few real search steps at half the parameters (hidden size, heads, FFN, and depth
    when ``depth``), then the budget met."""
    model = _tiny_lm(tie)
    x = torch.randint(0, 48, (2, 12), generator=torch.Generator().manual_seed(1))
    searcher = dms.prepare(model, x, dms.SearchConfig(resource="params", target=0.5, search_depth=depth,
                                                         settle=0.0))  # 6 steps: depth must move
    opt = torch.optim.Adam([{"params": list(searcher.model_parameters()), "lr": 1e-3},
                            {"params": list(searcher.structure_parameters()), "lr": 0.05}])
    model.train()
    for i in range(6):
        logits = model(x)
        loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 48), x[:, 1:].reshape(-1))
        loss = loss + searcher.resource_loss(i / 5)
        opt.zero_grad()
        loss.backward()
        opt.step()
    searcher.meet_target()
    model.eval()
    return model, searcher, x


@pytest.mark.parametrize("tie, depth", [(False, False), (True, True)])
def test_export_hidden_states_are_the_hardened_supernets_at_the_kept_channels(tie, depth):
    model, searcher, x = _searched(tie, depth)
    structure = searcher.structure()
    found = kept_hidden_channels(model, structure)
    assert found is not None, "the search kept the whole hidden size: nothing is tested"
    kept, size = found
    assert size == HIDDEN and 0 < len(kept) < HIDDEN and kept == sorted(set(kept))
    layers = structure["layers"]
    # one coupled group: the final norm's channels and the LM head's inputs are the same list
    assert layers["lm.model.norm"]["out"] == kept and layers["lm.lm_head"]["in"] == kept
    with torch.no_grad(), searcher.hardened():
        sup_logits, h_sup = model(x, output_hidden_states=True)
    small = searcher.export().eval()
    assert kept_hidden_channels(small, structure) == found  # found from the export's names too
    with torch.no_grad():
        logits, h = small(x, output_hidden_states=True)
    torch.testing.assert_close(logits, sup_logits, rtol=1e-5, atol=1e-5)
    assert h[-1].shape[-1] == len(kept)
    # h[0] the embeddings, h[j] the output of the j-th kept block (a removed block is the
    # identity, so that is the supernet's state after the same block), h[-1] the final state
    removed = {int(b["name"].rsplit(".", 1)[1]) for b in structure["removed_blocks"]}
    blocks = [k for k in range(len(h_sup) - 1) if k not in removed]
    assert len(h) == len(blocks) + 1 and (removed or not depth)
    pairs = [(h[0], h_sup[0])] + [(h[j + 1], h_sup[k + 1]) for j, k in enumerate(blocks[:-1])]
    pairs.append((h[-1], h_sup[-1]))
    # every block output and the final RMS-normalised state h[L]: the masked norms take
    # their statistics over the kept channels, so h[L] is exact at them too
    for mine, theirs in pairs:
        torch.testing.assert_close(mine, theirs[..., kept], rtol=1e-5, atol=1e-5)
    # the pruned channels are still computed in the supernet (nobody reads them): not zero
    pruned = [c for c in range(HIDDEN) if c not in kept]
    assert float(h_sup[1][..., pruned].abs().max()) > 0
    # so the loss against the hardened supernet as teacher is zero at the kept channels
    assert float(hidden_distill_loss(h, h_sup, teacher_channels=kept)) < 1e-10


def test_hidden_distill_loss_indexes_the_teacher_and_names_the_fix():
    g = torch.Generator().manual_seed(0)
    h_s = tuple(torch.randn(2, 3, 4, generator=g) for _ in range(3))
    h_t = tuple(torch.randn(2, 3, 6, generator=g) for _ in range(3))
    idx = [5, 0, 2, 3]
    by_hand = torch.stack([((s - t[..., idx]) ** 2).mean() for s, t in zip(h_s[1:], h_t[1:])]).mean()
    assert float(hidden_distill_loss(h_s, h_t, teacher_channels=idx)) == pytest.approx(float(by_hand))
    assert float(hidden_distill_loss(h_s, h_t, teacher_channels=torch.tensor(idx))) == pytest.approx(float(by_hand))
    with pytest.raises(ValueError, match="pass teacher_channels"):
        hidden_distill_loss(h_s, h_t)
    with pytest.raises(ValueError, match="after indexing"):
        hidden_distill_loss(h_s, h_t, teacher_channels=[0, 1])
    # fewer blocks: the final state only, indexed too
    short = h_s[:2]
    final = ((short[-1] - h_t[-1][..., idx]) ** 2).mean()
    assert float(hidden_distill_loss(short, h_t, idx)) == pytest.approx(float(final))


def test_distillation_passes_the_channels_to_the_hidden_term():
    class WithHidden(nn.Module):
        returns_hidden_states = True

        def __init__(self, d: int) -> None:
            super().__init__()
            self.body, self.head = nn.Linear(4, d), nn.Linear(d, 3)

        def forward(self, x, output_hidden_states=False):
            h = self.body(x)
            return (self.head(h), (x, h)) if output_hidden_states else self.head(h)

    torch.manual_seed(0)
    student, teacher = WithHidden(2), WithHidden(5)
    x = torch.randn(3, 4)
    _, terms = Distillation(teacher, weight=0.0, hidden_weight=2.0, teacher_channels=[4, 1])(Task(), student, x)
    assert [(n, w) for n, w, _ in terms] == [("distill_hidden_loss", 2.0)]
    want = ((student.body(x) - teacher.body(x)[:, [4, 1]]) ** 2).mean()
    assert float(terms[0][2].detach()) == pytest.approx(float(want.detach()))


def test_kept_hidden_channels_is_none_when_the_structure_does_not_say():
    model = _tiny_lm(tie=False)
    assert kept_hidden_channels(model, None) is None
    assert kept_hidden_channels(model, {"layers": {}}) is None
    entry = {"handler": "embedding", "in": None, "out": None, "shapes": {"weight": [48, HIDDEN]}}
    assert kept_hidden_channels(model, {"layers": {"lm.model.embed_tokens": entry}}) is None  # not pruned
    assert kept_hidden_channels(nn.Linear(2, 2), {"layers": {"": entry}}) is None  # no HF embedding
