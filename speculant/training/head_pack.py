"""The last step of `speculant train-head`: the trained head's linears rounded by GPTQ into the
block type the drafter runs them in (`models/head_quant.py`), written beside the head, and the
held-out figures of the head as those blocks compute (`heldout_packed` in recipe.json, whose
first-token calibration the drafter then starts from). `--pack-only` redoes it for the head in
OUT (a head trained before this step existed, or other calibration settings)."""
from __future__ import annotations

import json
import os
import sys
import time
from itertools import islice

import torch

from speculant.models.head_quant import quantize_head, save_packed, with_blocks
from speculant.training.head_batches import heldout_rows, row_stream
from speculant.training.head_fit import heldout_metrics, unroll
from speculant.training.head_kinds import HEAD_KINDS, TargetParts

CALIBRATION_SEED_OFFSET = 7919  # calibration rows are drawn apart from the training order


def calibration_rows(data, seq_len: int, num_rows: int, seed: int) -> list:
    """`num_rows` packed rows of the training shards (never the held-out answers)."""
    return list(islice(row_stream(data.shards, seq_len, seed + CALIBRATION_SEED_OFFSET),
                       num_rows))


def run_head(head, rows: list, num_steps: int) -> None:
    """The head over `rows` as training-time test unrolls it (its own draft steps included),
    every step's hidden through the LM head: what its linears see when it drafts."""
    for row in rows:
        for h, _idx, _valid in unroll(head, row, head.capture_layers, num_steps):
            head.draft_logits(h)


def pack_head(cfg, target, data) -> dict:
    """GPTQ the head in cfg.out into cfg.pack blocks, save them, and return the packed head's
    held-out figures (with how they were made)."""
    kind = HEAD_KINDS[cfg.kind]
    qtype = cfg.pack.upper()
    t0 = time.perf_counter()
    head = kind.load_head(cfg.out, target.config, TargetParts.of(target)).eval()
    rows = calibration_rows(data, cfg.seq_len, cfg.pack_rows, cfg.seed)
    if not rows:
        raise ValueError("train-head: no training rows to calibrate the packed blocks on")
    blocks = quantize_head(head, lambda: run_head(head, rows, cfg.ttt_steps), qtype,
                           cfg.pack_damp)
    info = {"method": "gptq", "calibration_rows": len(rows),
            "calibration_tokens": sum(r.num_tokens for r in rows), "damp": cfg.pack_damp}
    path = save_packed(cfg.out, blocks, qtype, info)
    packed = with_blocks(kind.load_head(cfg.out, target.config, TargetParts.of(target)).eval(),
                         blocks)
    heldout = heldout_rows(data.heldout, data.heldout_categories, cfg.seq_len)
    with torch.no_grad():
        metrics = heldout_metrics(packed, heldout, packed.capture_layers, cfg.ttt_steps)
    print(f"packed {qtype} blocks (GPTQ, {len(rows)} calibration rows) in "
          f"{time.perf_counter() - t0:.0f} s -> {path}: held-out first-token agreement "
          f"{metrics['first_token_agreement']}, expected accepted length "
          f"{metrics['expected_accepted_length']}", file=sys.stderr, flush=True)
    return {"qtype": qtype, "file": os.path.basename(path), **info, **metrics}


def write_packed_figures(out: str, figures: dict) -> None:
    """Merge `figures` into OUT/recipe.json as `heldout_packed`."""
    path = os.path.join(out, "recipe.json")
    recipe = {}
    if os.path.isfile(path):
        with open(path) as f:
            recipe = json.load(f)
    recipe["heldout_packed"] = figures
    with open(path + ".tmp", "w") as f:
        json.dump(recipe, f, indent=1)
    os.replace(path + ".tmp", path)
