"""The `speculant generate` contract: flags and --json fields used by automation."""
import json
import os
import subprocess
import sys

import pytest

from conftest import DEV_PROMPTS

CLI = [sys.executable, "-m", "speculant.cli.main"]
FIELDS = {"id", "text", "token_ids", "num_prompt_tokens", "num_generated", "time_s", "tokens_per_s",
          "queue_time_s", "prefill_time_s", "decode_time_s", "decode_tokens_per_s"}
SPEC_FIELDS = {"type_used", "num_drafts", "num_draft_tokens", "num_accepted_tokens",
               "mean_accepted_length", "mean_accepted_length_per_draft", "accepted_per_pos",
               "per_speculator"}


def run_cli(*args, check=True):
    proc = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=300)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


@pytest.mark.parametrize("extra", [[], ["--kv-dtype", "float32"]])
def test_generate_json_prints_one_object_with_the_contract_fields(extra):
    out = run_cli("generate", "Say hi.", "--max-tokens", "8", "--json",
                  *extra).stdout.strip().splitlines()
    assert len(out) == 1
    obj = json.loads(out[0])
    assert FIELDS <= set(obj) and SPEC_FIELDS <= set(obj["spec"])
    assert obj["num_generated"] == len(obj["token_ids"]) <= 8


def test_generate_prompts_file_with_batch_and_speculation(tmp_path):
    if not os.path.exists(DEV_PROMPTS):
        pytest.skip("dev prompts missing")
    lines = open(DEV_PROMPTS).read().splitlines()
    picked = [l for l in lines if '"code_edit"' in l][:1] + [l for l in lines if '"completion"' in l][:1]
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(picked) + "\n")
    out = run_cli("generate", "--prompts", str(f), "--batch", "2", "--max-tokens", "16", "--json",
                  "--spec-type", "ngram_simple", "--spec-n-max", "8", "--verify", "greedy").stdout
    objs = [json.loads(l) for l in out.strip().splitlines()]
    assert [o["id"] for o in objs] == [json.loads(p)["id"] for p in picked]
    assert all(o["spec"]["type_used"] == "ngram_simple" for o in objs)


def test_per_request_timings_separate_waiting_from_decoding(tmp_path):
    """At --batch 1 the second prompt waits for the first: its time_s includes that wait,
    queue_time_s says how long, and decode_tokens_per_s is (tokens after the first) / its own
    decode time."""
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"id": f"p{i}", "category": "cli", "turns": [t]}) + "\n"
                         for i, t in enumerate(["Count to ten.", "Name five fruits."])))
    out = run_cli("generate", "--prompts", str(f), "--batch", "1", "--max-tokens", "24",
                  "--ignore-eos", "--json").stdout
    first, second = [json.loads(line) for line in out.strip().splitlines()]
    assert first["queue_time_s"] < second["queue_time_s"]
    assert second["queue_time_s"] >= first["decode_time_s"]  # it waited for the first's decode
    for o in (first, second):
        assert o["time_s"] >= o["queue_time_s"] + o["decode_time_s"]
        assert abs(o["decode_tokens_per_s"] - (o["num_generated"] - 1) / o["decode_time_s"]) < 0.01 * \
            o["decode_tokens_per_s"] + 0.01
    assert second["tokens_per_s"] < second["decode_tokens_per_s"]


def test_ngram_cache_dynamic_table_is_saved_at_the_end_of_a_run(tmp_path):
    """The dynamic n-gram cache named by its option is written when the run ends, and a
    second run loads it."""
    table = tmp_path / "dynamic.bin"
    args = ("generate", "Count to ten.", "--max-tokens", "16", "--json", "--spec-type", "ngram_cache",
            "--spec-option", f"ngram_cache.lookup_cache_dynamic={table}")
    run_cli(*args)
    assert table.exists() and table.stat().st_size > 8
    run_cli(*args)


def test_plain_text_run_streams_and_ends_with_tokens_per_second():
    proc = run_cli("generate", "Count to five.", "--max-tokens", "12", "--spec-type", "ngram_simple")
    lines = proc.stdout.strip().splitlines()
    assert any("tok/s" in l for l in lines[-6:])
    assert any(l.startswith("ngram_simple") for l in lines)  # per-speculator statistics table


@pytest.mark.parametrize("args, message", [
    (["generate"], "PROMPT"),  # nothing to generate from
    (["generate", "hi", "--model", "/no/such/model.gguf"], "not found"),
    (["generate", "--prompts", "/no/such/file.jsonl"], "prompts file"),
    (["generate", "hi", "--spec-type", "bogus"], "bogus"),
    (["generate", "hi", "--temperature", "-1"], "temperature"),
])
def test_bad_input_exits_2_with_a_message_naming_the_problem(args, message):
    proc = run_cli(*args, check=False)
    assert proc.returncode == 2 and message in proc.stderr
