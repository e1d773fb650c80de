"""`speculant train-head --kind eagle3|mtp`: train a draft head on the target's features.

Kinds (`head_kinds`): `eagle3` (EAGLE-3's fused features of three layers) and `mtp`
(DeepSeek-V3's multi-token prediction module on the last layer's residual, applied recursively);
both are fitted by the same loop (`head_fit`).

Data (`head_data`): the target's own answers to real prompts with its hidden states captured
during generation, cached on disk (the layers a kind reads are part of the cache's spec, so a
cache made for one kind is refused by another). Draft vocabulary: the `draft_vocab` tokens the
target generates most in the training data (EOS always in). Loss: training-time test (EAGLE-3, Li et
al. 2025) with `ttt_steps` unrolled steps; at step j the head reads its own output hidden of
step j-1 and the next ground-truth token, and its draft-vocabulary distribution q_j is scored by

    loss = sum_j 0.8^j * CE(p_tgt restricted to the draft vocabulary and renormalised, q_j)

where p_tgt = softmax(lm_head(final_norm(h_{L-1})) / T) is the target's own next-token
distribution (T = `--label-temperature`, 1 by default), recomputed from the cached last-layer
residual. AdamW, linear warm-up then cosine decay, until
`--steps` or `--time-budget-min`; Ctrl-C stops and saves; a checkpoint in DIR resumes.

Held-out figures (`recipe.json`): on the target's greedy answers to prompts of judged categories,
the head is unrolled exactly as at inference (under greedy verification a draft step only
matters while every earlier step agreed, so feeding the ground truth is feeding the head's own
accepted tokens): first-token agreement per category, acceptance per draft position, expected
accepted length = 1 + mean accepted run per verification step.

This module imports torch inside functions: `speculant --help` stays fast.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from speculant.training.head_data import FeatureSpec

REPO_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_PROMPTS = os.path.normpath(os.path.join(REPO_DIR, "..", "shared", "data", "prompts_dev.jsonl"))
KINDS = ("eagle3", "mtp")  # the keys of head_kinds.HEAD_KINDS (that module imports torch)
TRAIN_DTYPES = ("auto", "bfloat16", "float32")
MAX_LAYERS = 8  # models.eagle3_head.MAX_LAYERS (that module imports torch)
PACK_TYPES = ("q4_1", "q4_0", "q8_0", "none")  # packed_head.HEAD_WEIGHTS blocks; none: no file
TRAIN_CATEGORIES = ("gsm8k", "code_completion")  # the only dev categories that are not judged
HELDOUT_CATEGORIES = ("mt_bench", "qa", "math_reasoning", "translation")
CACHE_DIRNAME = "head_cache"  # default --data-dir inside --out


@dataclass(slots=True)
class HeadTrainConfig:
    """Fields are the CLI flags of `speculant train-head`."""

    out: str
    kind: str = "eagle3"
    model: str = "default"
    data_dir: str | None = None  # the feature cache; default OUT/head_cache
    prompts: str = DEFAULT_PROMPTS
    train_categories: list[str] = field(default_factory=lambda: list(TRAIN_CATEGORIES))
    heldout_categories: list[str] = field(default_factory=lambda: list(HELDOUT_CATEGORIES))
    eval_prompts: int = 10  # held-out prompts per category
    num_items: int = 4000  # work-list prompts the cache should cover
    batch_items: int = 128  # prompts per generation batch (= per shard)
    max_new_tokens: int = 256
    max_prompt_tokens: int = 512
    temperature: float = 0.8  # of the sampled answers
    sharegpt_limit: int = 0  # 0 = every ShareGPT human turn
    max_num_seqs: int = 32  # sequences the engine decodes together while generating
    gen_time_budget_min: float = 60.0
    generate_only: bool = False
    # no training: measure the head saved in OUT on the held-out answers and update the
    # `heldout` figures of its recipe.json (e.g. a head made before a figure was added)
    eval_only: bool = False
    # the block type the drafter runs the head's linears in on the CPU, rounded by GPTQ on the
    # training data and written beside the head (`training/head_pack.py`); none: not written
    pack: str = "q4_1"
    pack_rows: int = 32  # calibration rows of --seq-len tokens from the training shards
    pack_damp: float = 0.01  # GPTQ's damping, a share of the inputs' mean square
    # no training: write the packed blocks of the head saved in OUT (and their held-out figures)
    pack_only: bool = False
    aux_layers: list[int] | None = None  # published ids (input of layer i); default EAGLE-3's
    draft_vocab: int = 8192
    # hidden units of the head's MLP (eagle3); 0 = the head this run continues (its checkpoint
    # or --init-head), else the target's width. Wider than the --init-head is a warm start that
    # computes the same at step 0 (the added units write nothing until trained)
    head_intermediate: int = 0
    # decoder layers of the head (eagle3); 0 = those of the head this run continues, else 1.
    # Deeper than the --init-head is a warm start that computes the same at step 0 (the added
    # layers write nothing until trained)
    head_layers: int = 0
    ttt_steps: int = 3
    # temperature of the target's distribution the head is trained towards: 1 = the target's
    # own (what rejection sampling at temperature 1 wants), below 1 sharpens it towards the
    # argmax that greedy verification accepts
    label_temperature: float = 1.0
    seq_len: int = 1024  # tokens per packed training row
    batch_size: int = 2  # rows per optimizer step
    lr: float = 1.5e-3  # measured: 40 steps reach 0.13 held-out agreement, 0.07 with 5e-4
    train_dtype: str = "auto"  # matmuls of training: bfloat16 where the CPU has AVX512-BF16
    steps: int = 0  # 0 = until the time budget
    time_budget_min: float = 40.0
    fresh: bool = False  # ignore a checkpoint in OUT
    init_head: str | None = None  # warm start from a trained head folder of the same kind
    extra_data: list[str] = field(default_factory=list)  # more caches (same spec, other --seed)
    # a prompt file in the dev format (e.g. translation requests) whose first turns make up
    # --train-prompts-share of the work list while they last
    train_prompts: str = ""
    train_prompts_share: float = 0.25
    threads: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"train-head: --kind must be one of {KINDS}, got {self.kind!r}")
        if self.aux_layers and self.kind != "eagle3":
            raise ValueError(f"train-head: --aux-layers is an eagle3 option ({self.kind} reads "
                             f"the target's last layer)")
        judged = set(self.train_categories) & set(self.heldout_categories)
        if judged:
            raise ValueError(f"train-head: categories {sorted(judged)} are both trained on and "
                             f"held out")
        for name in ("draft_vocab", "ttt_steps", "seq_len", "batch_size", "batch_items",
                     "max_new_tokens", "max_prompt_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"train-head: --{name.replace('_', '-')} must be >= 1")
        if self.head_intermediate < 0 or (self.head_intermediate and self.kind != "eagle3"):
            raise ValueError(f"train-head: --head-intermediate is an eagle3 option and must be "
                             f">= 0 (0 = the width of the head continued, else the target's), "
                             f"got {self.head_intermediate} with --kind {self.kind}")
        if not 0 <= self.head_layers <= MAX_LAYERS or (self.head_layers > 1
                                                         and self.kind != "eagle3"):
            raise ValueError(f"train-head: --head-layers is an eagle3 option and must be in "
                             f"[0, {MAX_LAYERS}] (0 = the depth of the head continued, else 1), "
                             f"got {self.head_layers} with --kind {self.kind}")
        if not 0.0 <= self.train_prompts_share < 1.0:
            raise ValueError(f"train-head: --train-prompts-share must be in [0, 1), got "
                             f"{self.train_prompts_share}")
        if self.train_prompts:
            self._check_train_prompts()
        if self.train_dtype not in TRAIN_DTYPES:
            raise ValueError(f"train-head: --train-dtype must be one of {TRAIN_DTYPES}")
        if not 0.0 < self.label_temperature <= 10.0:
            raise ValueError(f"train-head: --label-temperature must be in (0, 10], got "
                             f"{self.label_temperature}")
        if self.lr <= 0 or self.time_budget_min < 0 or self.gen_time_budget_min < 0:
            raise ValueError("train-head: --lr must be > 0 and time budgets >= 0")
        if self.data_dir is None:
            self.data_dir = os.path.join(self.out, CACHE_DIRNAME)
        if self.eval_only + self.generate_only + self.pack_only > 1:
            raise ValueError("train-head: --eval-only, --generate-only and --pack-only exclude "
                             "each other")
        if self.pack not in PACK_TYPES or (self.pack_only and self.pack == "none"):
            raise ValueError(f"train-head: --pack must be one of {PACK_TYPES} (not none with "
                             f"--pack-only), got {self.pack!r}")
        if self.pack_rows < 1 or not 0.0 < self.pack_damp <= 1.0:
            raise ValueError(f"train-head: --pack-rows must be >= 1 and --pack-damp in (0, 1], "
                             f"got {self.pack_rows} and {self.pack_damp}")

    def _check_train_prompts(self) -> None:
        """--train-prompts must be readable and hold none of the held-out categories."""
        from speculant.data.prompt_set import read_prompts

        categories = {r.category for r in read_prompts(self.train_prompts)}
        judged = categories & set(self.heldout_categories)
        if judged:
            raise ValueError(f"train-head: --train-prompts {self.train_prompts} holds held-out "
                             f"categories {sorted(judged)}")


def add_train_head_args(p: argparse.ArgumentParser) -> None:
    """Flags = HeadTrainConfig fields (defaults stated once, in the dataclass)."""
    defaults = HeadTrainConfig(out="-")
    for f in dataclasses.fields(HeadTrainConfig):
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name) if f.name != "data_dir" else None
        if f.name == "out":
            p.add_argument(flag, required=True, help="output folder of the head")
        elif f.name in ("kind", "train_dtype"):
            p.add_argument(flag, default=default,
                           choices=list(KINDS if f.name == "kind" else TRAIN_DTYPES))
        elif isinstance(default, bool):
            p.add_argument(flag, action="store_true")
        elif isinstance(default, list) or f.name == "aux_layers":
            p.add_argument(flag, default=None if default is None else ",".join(map(str, default)),
                           help="comma separated")
        elif f.name in ("data_dir", "threads", "init_head"):
            p.add_argument(flag, default=None, type=int if f.name == "threads" else str)
        else:
            p.add_argument(flag, default=default, type=type(default))


def config_from_args(args) -> HeadTrainConfig:
    kw = {}
    for f in dataclasses.fields(HeadTrainConfig):
        value = getattr(args, f.name)
        if f.name in ("train_categories", "heldout_categories", "extra_data"):
            value = [v for v in value.split(",") if v]
        elif f.name == "aux_layers" and value is not None:
            value = [int(v) for v in value.split(",") if v]
        kw[f.name] = value
    return HeadTrainConfig(**kw)


def feature_spec(cfg: HeadTrainConfig, target_config) -> FeatureSpec:
    """The data spec: the head's capture layers plus the last layer (for the soft labels)."""
    from speculant.models.loader import file_key, resolve_model
    from speculant.training.head_data import FeatureSpec
    from speculant.training.head_kinds import HEAD_KINDS

    read = HEAD_KINDS[cfg.kind].capture_layers(cfg, target_config)
    layers = sorted(set(read) | {target_config.num_layers - 1})
    return FeatureSpec(
        model_key=file_key(resolve_model(cfg.model).path), layers=layers, prompts=cfg.prompts,
        train_categories=list(cfg.train_categories),
        heldout_categories=list(cfg.heldout_categories), eval_prompts=cfg.eval_prompts,
        max_new_tokens=cfg.max_new_tokens, max_prompt_tokens=cfg.max_prompt_tokens,
        temperature=cfg.temperature, seed=cfg.seed, train_prompts=cfg.train_prompts,
        train_prompts_share=cfg.train_prompts_share if cfg.train_prompts else 0.0)


def run_train_head(args) -> int:
    import torch

    cfg = config_from_args(args)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    from speculant.models.loader import load_model
    from speculant.training.head_data import generate_data, load_with_extra

    target = load_model(cfg.model)
    spec = feature_spec(cfg, target.config)
    # 1) data: extend the feature cache (reused as is when it already covers --num-items)
    cache = generate_data(cfg.model, spec, cfg.data_dir, num_items=cfg.num_items,
                          batch_items=cfg.batch_items,
                          time_budget_s=0.0 if cfg.eval_only or cfg.pack_only
                          else cfg.gen_time_budget_min * 60,
                          threads=cfg.threads, max_num_seqs=cfg.max_num_seqs,
                          sharegpt_limit=cfg.sharegpt_limit or None)
    print(f"data: {cache.next_item} prompts, {cache.num_tokens} tokens in {cache.folder}",
          file=sys.stderr, flush=True)
    if cfg.generate_only:
        return 0
    if cfg.eval_only:
        return run_eval_only(cfg, target, load_with_extra(cache, []))
    if cfg.pack_only:
        return run_pack(cfg, target, load_with_extra(cache, cfg.extra_data))
    data = load_with_extra(cache, cfg.extra_data)
    # 2) the draft vocabulary, then the head (resumed from a checkpoint in OUT when present)
    from speculant.models.loader import resolve_model
    from speculant.models.tokenizer import load_tokenizer
    from speculant.training.head_fit import HeadFit

    eos_id = load_tokenizer(resolve_model(cfg.model)).eos_token_id
    fit = HeadFit(cfg, target, data, eos_id)
    fit.train()
    # 3) the head and its recipe
    recipe = fit.finish(recipe_command(cfg))
    with open(os.path.join(cfg.out, "recipe.json"), "w") as f:
        json.dump(recipe, f, indent=1)
    print_recipe(recipe)
    # 4) the blocks the drafter runs, rounded against what the head reads
    if cfg.pack != "none":
        run_pack(cfg, target, data)
    return 0


def run_pack(cfg: HeadTrainConfig, target, data) -> int:
    """--pack (after training) and --pack-only: the head in OUT rounded by GPTQ into --pack
    blocks beside it, their held-out figures merged into its recipe.json."""
    from speculant.training.head_pack import pack_head, write_packed_figures

    figures = pack_head(cfg, target, data)
    write_packed_figures(cfg.out, figures)
    print(json.dumps({"heldout_packed": {k: figures[k] for k in (
        "qtype", "first_token_agreement", "acceptance_per_pos", "expected_accepted_length",
        "per_category")}}), flush=True)
    return 0


def run_eval_only(cfg: HeadTrainConfig, target, data) -> int:
    """--eval-only: the held-out figures of the head in OUT, merged into its recipe.json (the
    figures of the run that made it, e.g. `agreement_init`, are kept)."""
    from speculant.training.head_fit import evaluate_saved_head

    metrics = evaluate_saved_head(cfg, target, data)
    path = os.path.join(cfg.out, "recipe.json")
    recipe = {}
    if os.path.isfile(path):
        with open(path) as f:
            recipe = json.load(f)
    recipe.setdefault("heldout", {}).update(metrics)
    recipe.setdefault("evaluations", []).append(recipe_command(cfg))
    with open(path + ".tmp", "w") as f:
        json.dump(recipe, f, indent=1)
    os.replace(path + ".tmp", path)
    print(json.dumps({"heldout": metrics}), flush=True)
    return 0


def recipe_command(cfg: HeadTrainConfig) -> str:
    """The command line that reproduces this run (flags that differ from the defaults)."""
    parts = ["speculant train-head"]
    defaults = HeadTrainConfig(out=cfg.out)
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name == "data_dir" and value == defaults.data_dir:
            continue
        if f.name in ("out", "kind") or value != getattr(defaults, f.name):
            if isinstance(value, bool):
                parts.append(f"--{f.name.replace('_', '-')}")
                continue
            shown = ",".join(map(str, value)) if isinstance(value, list) else value
            parts.append(f"--{f.name.replace('_', '-')} {shown}")
    return " ".join(parts)


def print_recipe(r: dict) -> None:
    d, t, h, v = r["data"], r["train"], r["heldout"], r["draft_vocab"]
    print(f"recipe: {r['command']}")
    print(f"data: {d['items']} prompts -> {d['sequences']} sequences, {d['tokens']} tokens "
          f"({d['generated_tokens']} generated by the target) in {d['generation_time_s']} s")
    print(f"draft vocabulary: {v['size']} tokens, held-out coverage {v['heldout_coverage']}; "
          f"95% coverage needs {v['tokens_for_95']} tokens")
    print(f"train: {t['steps']} steps, {t['tokens']} tokens, {t['time_s']} s, stopped by "
          f"{t['stopped_by']}; loss {t['first_loss']} -> {t['last_loss']}")
    print(f"held-out ({h['positions']} positions): first-token agreement {h['agreement_init']} "
          f"at init -> {h['first_token_agreement']}; per category {h['per_category']}")
    print(f"acceptance per draft position {h['acceptance_per_pos']}; expected accepted length "
          f"{h['expected_accepted_length']} ({r['train']['ttt_steps']} drafts)")
    print(json.dumps(r), flush=True)
