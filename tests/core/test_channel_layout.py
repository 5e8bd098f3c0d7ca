"""The channel layout of a search's gates: one gather for every hooked layer's channels, and
the masked norms' weights computed once per channel count (dmscale.core.channel_layout)."""

from __future__ import annotations

import torch

import dmscale as dms
from dmscale.core.channel_layout import ChannelLayout
from dmscale.core.masked_norm import mask_weights
from transformer_zoo import TZOO, output_tensor, task_loss


def test_arrange_keeps_the_layers_order_and_groups_the_norms_by_width():
    keyed = {"idx_a": torch.tensor([0, 1, 2]), "norm_x": torch.tensor([0, 1]), "out_b": torch.tensor([3]),
             "norm_y": torch.tensor([4, 5, 6]), "norm_z": torch.tensor([1, 0])}
    layout, index = ChannelLayout.arrange(keyed, {"norm_x", "norm_y", "norm_z"})
    assert layout.keys == ["idx_a", "out_b"] and layout.sizes == [3, 1]
    assert layout.norm_groups == [(["norm_x", "norm_z"], 2), (["norm_y"], 3)]
    assert index.tolist() == [0, 1, 2, 3, 0, 1, 1, 0, 4, 5, 6]
    width = torch.rand(7, requires_grad=True)
    channels, weights, _ = layout.split(width[index])
    for key, slots in keyed.items():  # every key reads its own slots
        assert torch.equal(channels[key], width[slots])
    for key in ("norm_x", "norm_y", "norm_z"):
        torch.testing.assert_close(weights[key], width[keyed[key]] / width[keyed[key]].sum())
    assert weights["norm_x"]._base is weights["norm_z"]._base  # one division for the width-2 norms


def test_mask_weights_gradcheck_in_float64():
    m = torch.rand(3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).requires_grad_()
    assert torch.autograd.gradcheck(mask_weights, (m,))


def _norm_weight_nodes(loss: torch.Tensor) -> int:
    seen, stack, count = set(), [loss.grad_fn], 0
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        count += "MaskWeights" in type(node).__name__
        stack.extend(n for n, _ in node.next_functions)
    return count


def test_every_masked_norm_of_a_vit_reads_its_weights_from_one_division():
    entry = TZOO["timm_deit_tiny"]
    model, x = entry.build().train(), entry.make_inputs()
    searcher = dms.prepare(model, x, dms.SearchConfig(target=0.5))
    layout = searcher.gates.forward_masks.layout
    assert sum(len(keys) for keys, _ in layout.norm_groups) >= 5  # norm1, norm2 per block, the final norm
    loss = task_loss(output_tensor(model(x))) + searcher.resource_loss(0.5)
    assert _norm_weight_nodes(loss) == len(layout.norm_groups) == 1
