"""The default model against Hugging Face transformers (same GGUF, fp32)."""

import pytest
import torch

from conftest import dev_prompts
from speculant.engine.forward_batch import SeqChunk, build_forward_batch
from speculant.bench.hf_peer import load_hf_model
from speculant.models.loader import default_model_path, load_model
from speculant.models.llama import Model
from speculant.data.prompt_set import first_turn_prompt


@pytest.fixture(scope="module")
def hf():
    return load_hf_model(default_model_path())


def forward_logits(model, ids):
    cache = model.new_kv_cache(num_blocks=64, block_size=16)
    cache.allocate(0)
    batch = build_forward_batch(cache, [SeqChunk(0, 0, ids, num_logits=len(ids))])
    return model.forward(batch, cache).logits


def test_fp32_logits_match_transformers(hf):
    hf_model, hf_tok = hf
    loaded = load_model("default", dtype="float32")
    model = Model(loaded.config, loaded.weights)
    ids = hf_tok.apply_chat_template([{"role": "user", "content": "Why is the sky blue?"}],
                                     add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0]
    assert (forward_logits(model, ids) - ref).abs().max().item() < 1e-3


# one dev prompt per category in the default suite, two (10 prompts) in the slow one
@pytest.mark.parametrize("per_category", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_fp32_greedy_64_tokens_identical_to_transformers_on_dev_prompts(hf, per_category):
    from speculant.llm import LLM
    from speculant.engine.sampling_params import SamplingParams, SpecParams

    hf_model, _ = hf
    llm = LLM("default", dtype="float32", max_num_seqs=10)
    recs = dev_prompts(["mt_bench", "qa", "summarization", "code_completion", "gsm8k"],
                       per_category)
    prompts = [first_turn_prompt(r, llm.tokenizer) for r in recs]
    ours = llm.generate(prompts, SamplingParams(max_tokens=64, temperature=0.0,
                                                spec=SpecParams(enabled=False)))
    for prompt, out in zip(prompts, ours):
        ids = torch.tensor([llm.tokenizer.encode(prompt)])
        with torch.no_grad():
            ref = hf_model.generate(ids, max_new_tokens=64, do_sample=False, eos_token_id=2,
                                    attention_mask=torch.ones_like(ids), pad_token_id=0)
        assert out.token_ids == ref[0, ids.shape[1]:].tolist()


def test_parity_command_reports_fp32_agreement_and_quantized_deviation(hf, capsys, tmp_path,
                                                                       monkeypatch):
    """`speculant parity` prints a table and a JSON last line; fp32 agrees with transformers to
    rounding, the shipped quantized weights deviate measurably (int8 activation blocks). (The
    transformers model is the module's, loaded once by the same `load_hf_model`.)"""
    import json

    from speculant.bench import hf_peer
    from speculant.cli.main import main
    monkeypatch.setattr(hf_peer, "load_hf_model", lambda path: hf)
    prompts = tmp_path / "prompts.jsonl"  # its own file: the test runs wherever the repo is
    prompts.write_text(json.dumps({"id": "q1", "category": "qa", "mode": "chat",
                                   "turns": ["Who wrote the novel Moby-Dick?"]}) + "\n")
    assert main(["parity", "--prompts", str(prompts), "--categories", "qa", "--limit", "1",
                 "--max-tokens", "8", "--dtypes", "float32,auto"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("Parity with transformers fp32")
    result = {r["dtype"]: r for r in json.loads(out[-1])["results"]}
    assert result["float32"]["max_abs_logit_dev"] < 1e-3
    assert result["float32"]["num_identical"] == 1 and result["float32"]["num_prompts"] == 1
    assert result["auto"]["max_abs_logit_dev"] > result["float32"]["max_abs_logit_dev"]


def test_parity_command_rejects_bad_limit():
    from speculant.cli.main import main

    assert main(["parity", "--limit", "0"]) == 2
