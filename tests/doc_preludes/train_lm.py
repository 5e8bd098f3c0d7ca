"""What docs/llm.md's "Prune your own LLM" elides (``# ... train``): three steps of the causal
LM's task loss plus the resource loss on one batch of tiny text. It runs in the block's
namespace: ``lm``, ``tok`` and ``searcher`` are the block's."""

import torch as _torch

_batch = tok(["ROMEO. But soft, what light through yonder window breaks?"] * 2, return_tensors="pt")["input_ids"]
_opt = _torch.optim.AdamW(lm.parameters(), lr=1e-3)
for _step in range(3):
    _loss = lm(input_ids=_batch, labels=_batch).loss + searcher.resource_loss(progress=(_step + 1) / 3)
    _opt.zero_grad()
    _loss.backward()
    _opt.step()
