"""A zoo of small transformers for tests (a helper module, not a test file).

:data:`TZOO` holds named :class:`TZooEntry` builders -- timm ViTs, Hugging Face Llama (GQA),
GPT-2 and BERT, and a ``torch.nn.TransformerEncoder`` -- each with deterministic example
inputs. Every build seeds torch with 0, builds the model from a config (never pretrained
weights), turns dropout off where the library lets us, and returns it in eval mode, so two
builds give identical models.

The entries also say what the search space should contain (issue 4): the module name prefix
of every transformer layer (one depth block each, and at least one ``<attention>.heads``
width dim per layer), and for causal LMs that greedy generation must survive export.

Outputs differ between libraries (a tensor, ``ModelOutput.logits``,
``BaseModelOutput.last_hidden_state``): :func:`output_tensor` picks the tensor the tests
compare, :func:`task_loss` is a scalar task loss on it for gradient and training steps.

Notes:
    * timm builds at ``img_size=32``: 2x2 patches of 16 plus a class token, 5 tokens.
    * Hugging Face models use the library's default attention (``sdpa``), set explicitly in
      the config; ``bos/eos/pad_token_id`` are ``None`` so that greedy generation always runs
      ``max_new_tokens`` steps; ``initializer_range`` is raised from 0.02 to 0.2 so that a
      random LM's next-token logits are well separated (greedy comparisons are not decided
      by 1e-6 rounding, and generation is not one repeated token).
    * :class:`TorchEncoderNet` builds its ``nn.TransformerEncoder`` with
      ``enable_nested_tensor=False`` (no nested-tensor conversion, which only applies with a
      padding mask anyway). Each ``nn.TransformerEncoderLayer`` still takes its fused
      ``torch._transformer_encoder_layer_fwd`` fast path in eval mode under ``no_grad``
      unless hooks are attached to it: the prepared supernet (hooked) runs the Python path,
      the original and the exported model (no hooks) run the fused kernel. The tests leave
      this as a user would have it: the export must be correct on either path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from zoo import ZooEntry

__all__ = ["TZooEntry", "TZOO", "TorchEncoderNet", "output_tensor", "task_loss", "token_ids", "search_steps"]

SEQ_LEN = 12
VOCAB = 64


@dataclass
class TZooEntry(ZooEntry):
    """A :class:`ZooEntry` with example inputs and what the search space should contain.

    Attributes:
        make_inputs: ``() -> inputs`` for ``model(**inputs)`` (dict) or ``model(inputs)``
            (tensor); deterministic (seeded generator), batch first.
        kind: "image", "encoder" or "causal_lm" (causal LMs are also tested with
            ``generate``).
        layers: module name of every transformer layer, in order: each is expected as a
            block of one depth dim, with an ``<attention module>.heads`` width dim below it.
    """

    make_inputs: Callable[[], Any] = None  # type: ignore[assignment]
    kind: str = "encoder"
    layers: list[str] = field(default_factory=list)


def token_ids(batch: int = 1, length: int = SEQ_LEN, seed: int = 1) -> torch.Tensor:
    """Deterministic token ids in [0, VOCAB), shape (batch, length)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, length), generator=g)


def output_tensor(out: Any) -> torch.Tensor:
    """The tensor to compare from a model's output: a tensor itself, ``.logits``
    (classification / causal LM heads) or ``.last_hidden_state`` (bare encoders)."""
    if isinstance(out, torch.Tensor):
        return out
    for key in ("logits", "last_hidden_state"):
        value = getattr(out, key, None)
        if value is None and isinstance(out, dict):
            value = out.get(key)
        if isinstance(value, torch.Tensor):
            return value
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise TypeError(f"cannot find an output tensor in {type(out).__name__}")


def task_loss(out: Any) -> torch.Tensor:
    """A scalar task loss: mean over positions of logsumexp over the last dim.

    Its gradient w.r.t. the output is a softmax (non-zero everywhere), so every kept
    element of every structural dim influences it.
    """
    return output_tensor(out).float().logsumexp(-1).mean()


def search_steps(run: Any, model: nn.Module, x: Any, searcher: Any, steps: int = 3) -> tuple[torch.Tensor, list, list]:
    """``steps`` SGD steps of ``task_loss + resource_loss(step / steps)`` through ``run`` (the
    model, or a compiled form of it); returns the last output, every gate's importance and ratio."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for step in range(steps):
        y = output_tensor(run(**x) if isinstance(x, dict) else run(x))
        loss = task_loss(y) + searcher.resource_loss(step / steps)
        opt.zero_grad()
        loss.backward()
        opt.step()
    gates = list(searcher.gates.width) + list(searcher.gates.depth)
    return y.detach(), [t.importance.clone() for t in gates], [t.a.detach().clone() for t in gates]


def _image(batch: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch, 3, 32, 32, generator=g)


def _ids_and_mask() -> dict[str, torch.Tensor]:
    ids = token_ids()
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _ids_only() -> dict[str, torch.Tensor]:
    return {"input_ids": token_ids()}


# --------------------------------------------------------------------------- builders
def _seeded_eval(fn: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        torch.manual_seed(0)
        return fn().eval()

    return build


def _timm_vit(name: str) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        from dmscale.core._compat import ensure_torchvision

        ensure_torchvision()
        import timm

        # drop_rate / attn_drop / proj_drop / drop_path default to 0 in timm's ViT
        return timm.create_model(name, pretrained=False, num_classes=10, img_size=32)

    return make


def _hf_llama() -> nn.Module:
    from dmscale.core._compat import ensure_torchvision

    ensure_torchvision()
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False, attention_dropout=0.0, initializer_range=0.2,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg)


def _hf_gpt2() -> nn.Module:
    from dmscale.core._compat import ensure_torchvision

    ensure_torchvision()
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=3, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=0.2,
        bos_token_id=None, eos_token_id=None, attn_implementation="sdpa",
    )  # tie_word_embeddings=True (default): lm_head.weight is transformer.wte.weight
    return GPT2LMHeadModel(cfg)


def _hf_bert() -> nn.Module:
    from dmscale.core._compat import ensure_torchvision

    ensure_torchvision()
    from transformers import BertConfig, BertModel

    cfg = BertConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=64,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation="sdpa",
    )
    return BertModel(cfg)


class TorchEncoderNet(nn.Module):
    """Linear(16 -> 32) -> TransformerEncoder(2 x (d_model 32, 4 heads, FFN 64)) -> Linear(32 -> 10).

    The input and output projections keep the model's own input and output widths out of
    the searched dims (d_model, heads, FFN are in between).

    Example:
        >>> TorchEncoderNet()(torch.randn(1, 10, 16)).shape
        torch.Size([1, 10, 10])
    """

    def __init__(self) -> None:
        super().__init__()
        self.proj_in = nn.Linear(16, 32)
        layer = nn.TransformerEncoderLayer(
            d_model=32, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True,
            norm_first=True,  # pre-norm: x + f(x) residuals, so depth is searchable
        )
        # no nested-tensor conversion; see the module docstring for the per-layer fast path
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.proj_out = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, T, 16)
        return self.proj_out(self.encoder(self.proj_in(x)))  # (B, T, 10)


def _encoder_input() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn(1, 10, 16, generator=g)


def _names(prefix: str, n: int) -> list[str]:
    return [f"{prefix}.{i}" for i in range(n)]


TZOO: dict[str, TZooEntry] = {
    e.name: e
    for e in [
        TZooEntry("timm_deit_tiny", _seeded_eval(_timm_vit("deit_tiny_patch16_224")), (1, 3, 32, 32),
                  make_inputs=_image, kind="image", layers=_names("blocks", 12)),
        TZooEntry("timm_vit_small", _seeded_eval(_timm_vit("vit_small_patch16_224")), (1, 3, 32, 32),
                  make_inputs=_image, kind="image", layers=_names("blocks", 12)),
        TZooEntry("hf_llama_gqa", _seeded_eval(_hf_llama), (1, SEQ_LEN),
                  make_inputs=_ids_only, kind="causal_lm", layers=_names("model.layers", 3)),
        TZooEntry("hf_gpt2", _seeded_eval(_hf_gpt2), (1, SEQ_LEN),
                  make_inputs=_ids_only, kind="causal_lm", layers=_names("transformer.h", 3)),
        TZooEntry("hf_bert", _seeded_eval(_hf_bert), (1, SEQ_LEN),
                  make_inputs=_ids_and_mask, kind="encoder", layers=_names("encoder.layer", 2)),
        TZooEntry("torch_transformer_encoder", _seeded_eval(TorchEncoderNet), (1, 10, 16),
                  make_inputs=_encoder_input, kind="encoder", layers=_names("encoder.layers", 2)),
    ]
}
