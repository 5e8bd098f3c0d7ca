"""Issue 55, item 5 (fast half): a ``--layer-uniform`` search of a Gemma 3 that removes layers
saves the standard ``gemma3_text`` (not the per-layer format): the search keeps the hidden
size, which Gemma's standard config derives its embedding scale from, and the kept layers keep
their own sliding or full attention in ``layer_types``. A per-layer search that asks for GGUF
is refused before its first step, naming ``--layer-uniform``."""

from __future__ import annotations

import json

import pytest

from dmscale.cli import main
from gemma3_tiny import LAYER_TYPES, make_tiny_gemma3

pytest.importorskip("sentencepiece")

COMMON = ["--task", "text", "--pipeline", "p-", "--resource", "params", "--epochs", "0.05", "--seq-len", "32",
          "--batch-size", "4", "--structure-lr", "0.2", "--distill-weight", "0", "--threads", "1", "--quiet"]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    return make_tiny_gemma3(tmp_path_factory.mktemp("gemma3_fast"), train_steps=0)


@pytest.fixture(autouse=True)
def _token_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DMSCALE_CACHE", str(tmp_path / "token-cache"))


def test_layer_uniform_keeps_the_hidden_size_and_saves_the_standard_format(gemma, tmp_path):
    model_dir, data = gemma
    run = tmp_path / "run"
    assert main(["search", "--model", f"hf:{model_dir}", "--data", str(data), "--layer-uniform",
                 "--target", "0.7", "--out", str(run), *COMMON]) == 0
    structure = json.loads((run / "structure.json").read_text())
    kept = [int(n.rsplit(".", 1)[1]) for n in structure["depth"][0]["kept"]]
    assert len(kept) < len(LAYER_TYPES)
    assert not any(w["name"].endswith("embed_tokens") for w in structure["width"])  # hidden size kept
    assert json.loads((run / "hf" / "dmscale.json").read_text())["format"] == "standard"
    config = json.loads((run / "hf" / "config.json").read_text())
    assert config["model_type"] == "gemma3_text" and config["layer_types"] == [LAYER_TYPES[i] for i in kept]


def test_a_per_layer_gemma3_search_for_gguf_is_refused_before_its_first_step(gemma, tmp_path, capsys):
    model_dir, data = gemma
    rc = main(["search", "--model", f"hf:{model_dir}", "--data", str(data), "--export", "gguf",
               "--target", "0.8", "--out", str(tmp_path / "run"), *COMMON])
    err = capsys.readouterr().err
    assert rc == 2 and "--layer-uniform" in err and "gemma3" in err
    assert not (tmp_path / "run").exists()
