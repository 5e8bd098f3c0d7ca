"""Issue 48: the tokenizer of a per-layer save loads in a fresh process, stdin closed, without
the custom-code prompt or the "model of type" warning, with ``trust_remote_code=True`` as its
model does (transformers 5 reads ``config.json`` before ``tokenizer_config.json``, so without
it ``AutoTokenizer`` asks whether to run the config's custom code)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tiny_hf import make_tiny_hf

_LOAD = ("import dmscale as d; d.ensure_torchvision(); import json, sys; "
         "from transformers import AutoTokenizer; "
         "t = AutoTokenizer.from_pretrained(sys.argv[1], trust_remote_code=True); "
         "print(json.dumps([type(t).__name__, t('To be, or not')['input_ids']]))")


@pytest.mark.slow  # a fresh process importing transformers: ~40 s on 2 shared cores
def test_a_per_layer_save_tokenizer_loads_without_prompt_or_warning(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dmscale.export.hf import save_pretrained
    from dmscale.tasks.language import CausalLM

    model_dir, _ = make_tiny_hf(tmp_path, 8_000)
    tok = AutoTokenizer.from_pretrained(model_dir)
    out = save_pretrained(CausalLM(AutoModelForCausalLM.from_pretrained(model_dir)), tmp_path / "saved",
                          tokenizer=tok, mode="per_layer")
    assert json.loads((out / "tokenizer_config.json").read_text())["tokenizer_class"] == type(tok).__name__
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.run([sys.executable, "-c", _LOAD, str(out)], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = proc.stdout + proc.stderr
    assert "Do you wish to run the custom code" not in text and "model of type" not in text, text[-2000:]
    name, ids = json.loads(proc.stdout.strip().splitlines()[-1])
    assert name == type(tok).__name__ and ids == tok("To be, or not")["input_ids"]
