"""The head-data work list: a prompt file mixed in at its share; caches made before a spec field
existed still load; a cache of other prompts trains beside the main one."""
import dataclasses
import json
import os

import pytest

from speculant.training import head_data
from speculant.training.head_data import FeatureCache, FeatureSpec, _mix_in, build_work_list
from speculant.training.head_trainer import HeadTrainConfig


class Template:
    """A stand-in tokenizer: the chat template is visible in the text."""

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return f"<user>{messages[0]['content']}</user>"


def spec_for(tmp_path, **overrides) -> FeatureSpec:
    dev = tmp_path / "dev.jsonl"
    dev.write_text(json.dumps({"id": "g", "category": "gsm8k", "mode": "chat",
                               "turns": ["What is 2 + 2?"]}) + "\n")
    fields = dict(model_key="m", layers=[1, 2], prompts=str(dev), train_categories=["gsm8k"],
                  heldout_categories=["qa"], eval_prompts=1, max_new_tokens=8,
                  max_prompt_tokens=64, temperature=0.8, seed=0)
    return FeatureSpec(**{**fields, **overrides})


def test_mix_in_spreads_the_extra_items_at_their_share_while_they_last():
    assert _mix_in(list("abcdef"), ["X", "Y"], 0.25) == list("aXbcdYef")
    assert _mix_in(list("abcdefgh"), ["X", "Y", "Z"], 0.5) == list("aXbYcZdefgh")
    assert _mix_in(list("abc"), ["X"], 0.0) == list("abc")


def test_the_train_prompts_make_up_their_share_of_the_work_list(tmp_path):
    prompts = tmp_path / "de.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"d{i}", "category": "translation_de",
                                           "mode": "chat", "turns": [f"Übersetze Satz {i}"]}) + "\n"
                               for i in range(10)))
    turns = [f"question {i}" for i in range(60)]
    plain = build_work_list(spec_for(tmp_path), turns, Template())
    mixed = build_work_list(spec_for(tmp_path, train_prompts=str(prompts),
                                     train_prompts_share=0.25), turns, Template())
    from_file = [w for w in mixed if w.source == "file"]
    assert sorted(w.text for w in from_file) == sorted(f"<user>Übersetze Satz {i}</user>"
                                                      for i in range(10))
    assert {w.category for w in from_file} == {"translation_de"}
    # a quarter of the list until the file runs out; the other items keep their order
    last = max(i for i, w in enumerate(mixed) if w.source == "file")
    assert abs(len(from_file) / (last + 1) - 0.25) < 0.05
    assert [w for w in mixed if w.source != "file"] == plain


def test_a_cache_made_before_the_train_prompt_fields_still_loads(tmp_path):
    spec = spec_for(tmp_path)
    old = dataclasses.asdict(spec)
    del old["train_prompts"], old["train_prompts_share"]
    (tmp_path / "manifest.json").write_text(json.dumps({"spec": old, "shards": [],
                                                        "heldout": None}))
    assert FeatureCache(str(tmp_path), spec).manifest["spec"] == dataclasses.asdict(spec)
    with pytest.raises(ValueError, match="train_prompts"):
        FeatureCache(str(tmp_path), dataclasses.replace(spec, train_prompts="x.jsonl"))


def test_an_extra_cache_may_differ_in_its_prompts_only(tmp_path):
    spec = spec_for(tmp_path)
    other = dataclasses.replace(spec, seed=3, train_prompts="de.jsonl", train_prompts_share=0.5)
    (tmp_path / "manifest.json").write_text(json.dumps({"spec": dataclasses.asdict(other),
                                                        "shards": [], "heldout": None}))
    assert FeatureCache(str(tmp_path), spec, any_seed=True).manifest["spec"]["seed"] == 3
    with pytest.raises(ValueError, match="max_new_tokens"):
        FeatureCache(str(tmp_path), dataclasses.replace(spec, max_new_tokens=9), any_seed=True)


def test_train_prompts_holding_a_held_out_category_are_refused(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "q", "category": "qa", "mode": "chat",
                                   "turns": ["Who wrote Hamlet?"]}) + "\n")
    with pytest.raises(ValueError, match=r"held-out categories \['qa'\]"):
        HeadTrainConfig(out="-", train_prompts=str(prompts))
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        HeadTrainConfig(out="-", train_prompts=str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="train-prompts-share"):
        HeadTrainConfig(out="-", train_prompts_share=1.0)
