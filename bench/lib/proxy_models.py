"""The models of the search-step proxies (``python -m bench.search_proxies``, ``bench.host_time``):
each model with its inputs at a batch size, its task loss and its search target, and one
training step of a plain or a DMS model (SGD on the weights, Adam on the ratios)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

__all__ = ["ProxyModel", "PROXY_MODELS", "QUICK"]


@dataclass(frozen=True)
class ProxyModel:
    """A model, its inputs at a batch size, its task loss and its search target."""

    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[int], Any]
    loss: Callable[[Any, Any], torch.Tensor]
    batch: int  # the batch of the bytes-saved trace (the GPU benchmark's)
    target: float = 0.5
    shape: str = ""
    # the batch the operators are counted at: the smallest at which every mask takes the path it
    # takes at ``batch`` (a fold multiplies the smaller of a layer's weight and its input or output,
    # call by call: core.weight_masks), so that the counts are the real batch's
    ops_batch: int = 2


def _images(size: int, channels: int = 3) -> Callable[[int], torch.Tensor]:
    return lambda b: torch.randn(b, channels, size, size, generator=torch.Generator().manual_seed(0))


def _tokens(length: int, vocab: int) -> Callable[[int], dict[str, torch.Tensor]]:
    return lambda b: {"input_ids": torch.randint(0, vocab, (b, length), generator=torch.Generator().manual_seed(0))}


def _ce(out: Any, x: Any) -> torch.Tensor:
    out = out.float()
    return nn.functional.cross_entropy(out, torch.arange(out.shape[0], device=out.device) % out.shape[1])


def _lm(out: Any, x: dict[str, torch.Tensor]) -> torch.Tensor:
    logits, ids = out.logits[:, :-1].float(), x["input_ids"][:, 1:]
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids.reshape(-1))


def _tv(name: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import dmscale as dms
        dms.ensure_torchvision()
        import torchvision
        torch.manual_seed(0)
        return getattr(torchvision.models, name)()
    return build


def _timm(name: str, **kw: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import dmscale as dms
        dms.ensure_torchvision()
        import timm
        torch.manual_seed(0)
        return timm.create_model(name, pretrained=False, **kw)
    return build


def _llama(layers: int, hidden: int, ffn: int, heads: int, kv: int, vocab: int) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import dmscale as dms
        dms.ensure_torchvision()
        import transformers
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                                       num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                                       max_position_embeddings=2048, tie_word_embeddings=True)
        return transformers.LlamaForCausalLM(cfg)
    return build


def _small_cnn() -> nn.Module:
    from dmscale.tasks.models import SmallCNN
    torch.manual_seed(0)
    return SmallCNN()


PROXY_MODELS: dict[str, ProxyModel] = {m.name: m for m in [
    # ops_batch 42: from there on only layer4's 3x3 convolutions (7 px) and fc multiply their input, as at
    # batch 64 (below, layer4's 1x1 convolutions and, below 12, layer3's take their inputs too)
    ProxyModel("resnet50", _tv("resnet50"), _images(224), _ce, 64, shape="torchvision, 224 px, batch 64",
               ops_batch=42),
    # 16 x 197 tokens: fc2's output (3152 x 768) outgrows its weight (768 x 3072) as at batch 64
    ProxyModel("vit_b16", _timm("vit_base_patch16_224"), _images(224), _ce, 64, shape="timm, 224 px, batch 64",
               ops_batch=16),
    # 4 x 512 tokens: down_proj's output (2048 x 576) outgrows its weight (576 x 1536)
    ProxyModel("llama_135m", _llama(30, 576, 1536, 9, 3, 49152), _tokens(512, 49152), _lm, 16, target=0.8,
               shape="SmolLM2-135M's shape, random init, 16 x 512 tokens", ops_batch=4),
    ProxyModel("small_cnn", _small_cnn, _images(28, 1), _ce, 64, shape="dmscale SmallCNN, 28 px, batch 64"),
    ProxyModel("vit_s16", _timm("vit_small_patch16_224", num_classes=10), _images(224), _ce, 64,
               shape="timm ViT-S/16, 224 px, batch 64", ops_batch=8),  # fc2: 1576 x 384 outputs, 384 x 1536 weight
    ProxyModel("llama_small", _llama(4, 64, 128, 4, 2, 256), _tokens(32, 256), _lm, 8, target=0.8,
               shape="Llama, 4 layers, d 64, GQA 4/2, random init, 8 x 32 tokens", ops_batch=8),
]}
QUICK = ["small_cnn", "vit_s16"]


def _call(model: nn.Module, x: Any) -> Any:
    return model(**x) if isinstance(x, dict) else model(x)


def _prepare(spec: ProxyModel, model: nn.Module, x: Any, fuse_norms: bool = False) -> Any:
    import dmscale as dms
    example = {k: v[:1] for k, v in x.items()} if isinstance(x, dict) else x[:1]
    extra = {"fuse_norms": True} if fuse_norms else {}  # (the old code has no such option)
    return dms.prepare(model, example, dms.SearchConfig(resource="macs", target=spec.target, **extra))


def _step_fn(spec: ProxyModel, model: nn.Module, x: Any, searcher: Any) -> Callable[[], None]:
    params = list(searcher.model_parameters()) if searcher is not None else list(model.parameters())
    # foreach: the multi-tensor optimiser a GPU runs by default (on a CPU torch would loop)
    opt_w = torch.optim.SGD(params, lr=1e-4, foreach=True)
    opt_s = torch.optim.Adam(searcher.structure_parameters(), lr=1e-3, foreach=True) if searcher is not None else None

    def step(optimise: bool = True) -> None:
        loss = spec.loss(_call(model, x), x)
        if searcher is not None:
            loss = loss + searcher.resource_loss(0.5)
        opt_w.zero_grad()
        if opt_s is not None:
            opt_s.zero_grad()
        loss.backward()
        if not optimise:
            return
        opt_w.step()
        if opt_s is not None:
            opt_s.step()
    return step
