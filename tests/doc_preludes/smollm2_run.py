"""Hidden setup of docs/llm.md's "Load the result with plain transformers": a stand-in for the
SmolLM2 run's ``runs/smollm2/hf`` (written by ``dms.save_pretrained`` as that run writes it),
from the tiny Llama of tests/tiny_hf.py searched at 80 % of its parameters for one step."""

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import dmscale as dms
from tiny_hf import make_tiny_hf

model_dir, _ = make_tiny_hf(Path("tiny"))
lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
tok = AutoTokenizer.from_pretrained(model_dir)
searcher = dms.prepare(lm, {"input_ids": tok("Some text", return_tensors="pt")["input_ids"]},
                       dms.SearchConfig(resource="params", target=0.8, layer_uniform=True,
                                        exclude=["model.embed_tokens"]))
ids = tok(["ROMEO. But soft, what light through yonder window breaks?"] * 2, return_tensors="pt")["input_ids"]
loss = lm(input_ids=ids, labels=ids).loss + searcher.resource_loss(progress=1.0)
loss.backward()  # one step's gradients: the importance the export ranks by
torch.optim.AdamW(lm.parameters(), lr=1e-3).step()
searcher.meet_target()
dms.save_pretrained(searcher.export(), "runs/smollm2/hf", tokenizer=tok)
del lm, tok, searcher, model_dir, ids, loss
