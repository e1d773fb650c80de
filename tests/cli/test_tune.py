"""`speculant tune` writes a parameters file; `--spec-params FILE` applies it."""
import argparse
import json

import pytest

from test_cli import run_cli
from speculant.cli.options import add_engine_args, engine_options
from speculant.engine.spec_params import SpecSetting, read_spec_params, write_spec_params


def parse_engine_flags(*flags):
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p.parse_args(list(flags))


def test_spec_params_apply_to_their_chain_and_explicit_flags_win(tmp_path):
    path = str(tmp_path / "params.json")
    write_spec_params(path, {"suffix,ngram_mod": SpecSetting(4, 0.2, 150.0, 1.3),
                             "suffix": SpecSetting(0, 0.0)}, {"cpu": "test"}, 1)
    opts = engine_options(parse_engine_flags("--spec-type", "ngram_mod,suffix", "--spec-params", path), 1)
    assert (opts["spec_n_max"], opts["spec_p_min"]) == (4, 0.2)  # chain order does not matter
    opts = engine_options(parse_engine_flags("--spec-type", "suffix", "--spec-params", path), 1)
    assert opts["spec_n_max"] == 0  # plain won for suffix alone: speculation off
    opts = engine_options(parse_engine_flags("--spec-type", "ngram_mod,suffix", "--spec-params", path,
                                             "--spec-n-max", "7"), 1)
    assert opts["spec_n_max"] == 7


@pytest.mark.parametrize("body, message", [
    ("not json", "not JSON"),
    (json.dumps({"format": "other"}), "format"),
    (json.dumps({"format": "speculant-spec-params/1", "methods": {"a": {"spec_n_max": 999, "spec_p_min": 0}}}),
     "spec_n_max"),
])
def test_bad_spec_params_file_is_named(tmp_path, body, message):
    path = tmp_path / "bad.json"
    path.write_text(body)
    with pytest.raises(ValueError, match=message):
        read_spec_params(str(path))


def test_tune_command_measures_and_writes_a_loadable_file(tmp_path):
    """A tiny search (one prompt, two limits) prints its table and writes the best setting."""
    out = str(tmp_path / "params.json")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "q1", "category": "qa", "mode": "chat",
                                   "turns": ["Repeat: red, green, blue, red, green, blue."]}) + "\n")
    proc = run_cli("tune", "--prompts", str(prompts), "--categories", "qa", "--limit", "1",
                   "--max-tokens", "16", "--grid", "2,8", "--spec-type", "ngram_mod,suffix",
                   "--out", out)
    assert "| ngram_mod,suffix | 2 |" in proc.stdout and "| ngram_mod,suffix | 8 |" in proc.stdout
    setting = read_spec_params(out)["ngram_mod,suffix"]
    assert setting.spec_n_max in (0, 2, 8)


def test_tune_refuses_methods_with_options_of_their_own(tmp_path, capsys):
    """`speculant tune` searches n_max / p_min per chain; a bench-style `CHAIN[...]` method is
    refused by name (pointing to --spec-option) before any model loads."""
    from speculant.cli.main import main

    assert main(["tune", "--prompts", str(tmp_path / "none.jsonl"),
                 "--spec-type", "suffix;suffix[max_spec_factor=0.5]"]) == 2
    err = capsys.readouterr().err
    assert "per-method options" in err and "--spec-option" in err
