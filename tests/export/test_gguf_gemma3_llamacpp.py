"""Issue 55, item 5 (slow): a Gemma 3 searched ``--layer-uniform`` with layers removed exports
as the standard ``gemma3_text`` (its kept layers' ``layer_types``) and as GGUF in llama.cpp's
``gemma3`` architecture (a sliding/full boolean per kept layer, the SentencePiece vocabulary
built from ``tokenizer.model`` as llama.cpp's converter builds it); llama.cpp built from source
continues a prompt with transformers' greedy tokens, tokenizes held-out text as the Hugging
Face tokenizer does, and its perplexity is within 1 % of transformers' over the same tokens."""

from __future__ import annotations

import json

import pytest

from dmscale.cli import main
from gemma3_tiny import LAYER_TYPES, make_tiny_gemma3
from llamacpp import greedy_equal, held_out, llamacpp_tokens, perplexities

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gemma_run(tmp_path_factory):
    pytest.importorskip("sentencepiece")
    root = tmp_path_factory.mktemp("gemma3")
    model_dir, data = make_tiny_gemma3(root)
    run = root / "run"
    mp = pytest.MonkeyPatch()
    mp.setenv("DMSCALE_CACHE", str(root / "token-cache"))
    try:
        rc = main(["search", "--model", f"hf:{model_dir}", "--task", "text", "--data", str(data),
                   "--pipeline", "p-", "--layer-uniform", "--search-dims", "depth", "--export", "gguf",
                   "--gguf-type", "f32", "--resource", "params", "--target", "0.75", "--epochs", "0.05",
                   "--seq-len", "48", "--batch-size", "4", "--structure-lr", "0.2", "--distill-weight", "0",
                   "--threads", "1", "--out", str(run), "--quiet"])
    finally:
        mp.undo()
    assert rc == 0
    return model_dir, run


def test_a_layer_uniform_gemma3_saves_the_standard_format_with_its_layer_types(gemma_run):
    _, run = gemma_run
    structure = json.loads((run / "structure.json").read_text())
    kept = [int(n.rsplit(".", 1)[1]) for n in structure["depth"][0]["kept"]]
    assert len(kept) < len(LAYER_TYPES)  # the depth search removed layers
    assert json.loads((run / "hf" / "dmscale.json").read_text())["format"] == "standard"
    config = json.loads((run / "hf" / "config.json").read_text())
    assert config["model_type"] == "gemma3_text" and "auto_map" not in config
    assert config["layer_types"] == [LAYER_TYPES[i] for i in kept]


def test_the_gguf_runs_in_llamacpp_as_transformers_does(gemma_run, tmp_path):
    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir, run = gemma_run
    path = run / "model.gguf"
    fields = gguf.GGUFReader(path).fields
    assert fields["general.architecture"].contents() == "gemma3"
    config = json.loads((run / "hf" / "config.json").read_text())
    assert fields["gemma3.attention.sliding_window_pattern"].contents() == [
        t == "sliding_attention" for t in config["layer_types"]]
    assert fields["tokenizer.ggml.model"].contents() == "llama"
    small = AutoModelForCausalLM.from_pretrained(run / "hf").eval()  # plain transformers
    tok = AutoTokenizer.from_pretrained(run / "hf")
    text = greedy_equal(small, tok, path)
    ppl_cpp, ppl_hf, tokens = perplexities(small, path, tmp_path, bos=tok.bos_token_id)
    print(f"Gemma 3 ({len(config['layer_types'])} of {len(LAYER_TYPES)} layers): {text!r}; perplexity "
          f"llama.cpp {ppl_cpp:.4f}, transformers {ppl_hf:.4f} ({len(tokens)} tokens)")
    assert abs(ppl_cpp / ppl_hf - 1) < 0.01
    want = tok(held_out())["input_ids"]
    assert tokens == want[:len(tokens)]  # llama.cpp tokenizes the text as the Hugging Face tokenizer


def test_a_broken_vocabulary_fails_the_check(gemma_run, tmp_path):
    """The check of the check: the same export with the merge scores of the vocabulary negated
    (llama.cpp's SentencePiece tokenizer merges by score) tokenizes differently."""
    import gguf
    from transformers import AutoTokenizer

    _, run = gemma_run
    reader = gguf.GGUFReader(run / "model.gguf")
    broken = tmp_path / "broken.gguf"
    writer = gguf.GGUFWriter(broken, "gemma3")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = field.contents()
        if key == "tokenizer.ggml.scores":
            value = [-v for v in value]
        vtype = field.types[0]
        writer.add_key_value(key, value, vtype, sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tok = AutoTokenizer.from_pretrained(run / "hf")
    text = held_out()[:2000]
    assert llamacpp_tokens(run / "model.gguf", text, tmp_path) == tok(text)["input_ids"]
    assert llamacpp_tokens(broken, text, tmp_path) != tok(text)["input_ids"]
