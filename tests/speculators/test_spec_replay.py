"""The offline replay simulator."""
import json
import random

import pytest

from speculant.speculators.base import DraftParams, SpeculatorContext
from speculant.speculators.registry import speculator_class
from speculant.speculators.replay import load_records, main, replay, replay_record

CTX = SpeculatorContext(vocab_size=1000)
PARAMS = DraftParams(n_max=8)


def copy_record(seed=0):
    """A prompt of random tokens and an answer that repeats two spans of it."""
    rng = random.Random(seed)
    prompt = [rng.randrange(1000) for _ in range(300)]
    return {"prompt_ids": prompt, "output_ids": prompt[40:120] + [7, 8] + prompt[200:260]}


def make(name, **cfg):
    cls = speculator_class(name)
    return cls(CTX, cls.config_class(**cfg))


@pytest.mark.parametrize("name, cfg", [
    ("suffix", {}),  # defaults
    ("ngram_cache", {}),  # defaults
    ("ngram_simple", {"size_n": 3, "size_m": 16}),
    ("ngram_map_k", {"size_n": 3, "size_m": 16}),
    ("ngram_mod", {"n_match": 4, "n_min": 2, "pool_size": 1 << 16}),
])
def test_copying_output_is_drafted(name, cfg):
    """An answer copied from the prompt replays at mean accepted length > 2."""
    rec = copy_record()
    stats = replay_record(make(name, **cfg), rec["prompt_ids"], rec["output_ids"], PARAMS)
    assert stats.mean_accepted_length > 2
    assert stats.num_generated == len(rec["output_ids"])


def test_step_accounting():
    """Every decode step yields its accepted tokens plus one target token; the first token
    comes from the prefill."""
    rec = copy_record(1)
    stats = replay_record(make("suffix"), rec["prompt_ids"], rec["output_ids"], PARAMS)
    assert stats.num_generated == 1 + stats.num_steps + stats.num_accepted_tokens
    assert stats.num_decoded == stats.num_generated - 1
    assert sum(stats.accepted_per_pos) == stats.num_accepted_tokens
    assert stats.accepted_per_pos == sorted(stats.accepted_per_pos, reverse=True)
    assert len(stats.accepted_per_pos) <= 8


def test_unpredictable_output_costs_one_step_per_token():
    """With nothing to copy, no draft is accepted: one step per generated token."""
    rng = random.Random(2)
    prompt = list(range(100, 200))
    output = [rng.randrange(1000) for _ in range(50)]
    stats = replay_record(make("ngram_simple", size_n=3), prompt, output, PARAMS)
    assert stats.num_steps == 49 and stats.num_accepted_tokens == 0
    assert stats.mean_accepted_length == 1.0


def test_replay_totals_and_shared_state():
    """Records run through one instance: the suffix global tree learns from the first."""
    rec = copy_record(3)
    repeat = {"prompt_ids": [5, 6, 7], "output_ids": rec["output_ids"]}
    per_record, total = replay(make("suffix"), [rec, repeat], PARAMS)
    assert total.num_steps == per_record[0].num_steps + per_record[1].num_steps
    assert total.num_records == 2
    assert per_record[1].mean_accepted_length > 2  # cold prompt, answer seen before


def test_main_prints_json_summary(tmp_path, capsys):
    path = tmp_path / "records.jsonl"
    path.write_text("\n".join(json.dumps(copy_record(s)) for s in range(2)) + "\n")
    summary = main(["--records", str(path), "--spec-type", "ngram_simple", "--n-max", "8",
                    "--set", "size_n=3"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last) == summary
    assert summary["num_records"] == 2 and summary["mean_accepted_length"] > 2


def test_load_records_rejects_missing_fields(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt_ids": [1]}) + "\n")
    with pytest.raises(ValueError, match="record 0"):
        load_records(str(path))
