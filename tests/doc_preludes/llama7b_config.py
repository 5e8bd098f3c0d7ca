"""Hidden setup of docs/distributed.md's worked example: ``llama-2-7b/``, a directory holding
only the ``config.json`` of Llama-2-7B (no weights, no tokenizer), as a reader may download
it alone to plan a search."""

import json
from pathlib import Path

config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000,
          "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
          "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 4096,
          "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "torch_dtype": "float16"}
Path("llama-2-7b").mkdir(exist_ok=True)
Path("llama-2-7b/config.json").write_text(json.dumps(config, indent=1) + "\n", encoding="utf-8")
