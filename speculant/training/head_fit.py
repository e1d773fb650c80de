"""Fitting a drafter head (EAGLE-3 or MTP) to cached target features: the loop, its maths and
its figures.

`HeadFit` holds the run's state (head, optimizer, data streams, the target's frozen final norm
and LM-head rows of the draft vocabulary); what differs per head kind (layers read, the head's
start) is a `HeadKind` (`head_kinds.py`). The maths is pure functions over any head with the
per-step API of `speculators/feature_drafter.py`: `unroll` (training-time test, k steps),
`target_probs` (the soft labels), `soft_ce`, `heldout_metrics`, `draft_vocab` and `coverage`.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time

import torch

from speculant.models.eagle3_head import rms_norm, run_layers
from speculant.speculators.calibration import first_token_table
from speculant.training.head_batches import Row, heldout_rows, row_stream
from speculant.training.head_kinds import HEAD_KINDS, TargetParts
from speculant.training.ttt_attention import row_mask, ttt_attention

STEP_WEIGHT = 0.8  # EAGLE-3's loss weight decay per unrolled step
WARMUP_STEPS = 20
MIN_LR_FRACTION = 0.1  # the cosine schedule ends at this fraction of --lr
CHECKPOINT_EVERY_S = 300
EVAL_EVERY_S = 900
CHECKPOINT = "checkpoint.pt"


# ---- maths ------------------------------------------------------------------------------------

def unroll(head, row: Row, layers, num_steps: int):
    """Training-time test over one packed row: step j's head row r reads the token at r+1+j
    and (step 0) the (fused) target feature at r or (step j > 0) its own step j-1 output.
    Returns per step (h_out [T, d], label index [T], valid [T] bool), where the label of row r
    is the target's distribution at r+1+j (it predicts the token at r+2+j); valid rows have
    that distribution and the target generated the predicted token."""
    mask = row_mask(row.doc_ids)  # [T, T]
    hidden = head.fuse(row.features(layers))  # [T, d]
    num_layers = getattr(head, "num_layers", 1)
    # per decoder layer, the rotated keys and values of every step so far
    keys, values = [[] for _ in range(num_layers)], [[] for _ in range(num_layers)]
    out = []
    for j in range(num_steps):
        idx, inside = row.shifted(1 + j)
        pos = row.positions + 1 + j  # rope position of the token read at this step

        def attend(layer, q, k, v, pos=pos):
            keys[layer].append(head.apply_rope(k, pos))
            values[layer].append(v)
            return ttt_attention(head.apply_rope(q, pos), keys[layer], values[layer], mask)

        hidden = run_layers(head, head.embed(row.token_ids[idx]), hidden, attend)
        valid = inside & row.has_feature & row.has_feature[idx] & row.next_is_output[idx]
        out.append((hidden, idx, valid))
    return out


def target_probs(h_last: torch.Tensor, final_norm: torch.Tensor, label_head: torch.Tensor,
                 eps: float, temperature: float = 1.0) -> torch.Tensor:
    # h_last [n, d] residual after the target's last layer; label_head [draft_vocab, d]
    """-> [n, draft_vocab]: the target's next-token distribution renormalised on the draft
    vocabulary (softmax over the draft vocabulary's logits only), at `temperature`: 1 is the
    target's own distribution; below 1 sharpens it towards its argmax, what greedy
    verification accepts (the head's capacity goes to the top token, not the tail's shape)."""
    logits = rms_norm(h_last.float(), final_norm, eps) @ label_head.T  # [n, draft_vocab]
    return torch.softmax(logits / temperature, dim=-1)


def soft_ce(logits: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    # logits [n, V] draft; probs [n, V] target -> scalar sum over rows of -sum p log q
    return -(probs * torch.log_softmax(logits, dim=-1)).sum()


def draft_vocab(generated: torch.Tensor, size: int, eos_id: int | None,
                vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    # generated [n] target ids the target generated
    """(the `size` most generated ids, ascending, EOS always in; counts [vocab] per id)."""
    counts = torch.bincount(generated.long(), minlength=vocab_size)
    order = torch.argsort(counts, descending=True, stable=True)
    chosen = order[:size]
    if eos_id is not None and eos_id not in chosen.tolist():
        chosen = torch.cat([chosen[:size - 1], torch.tensor([eos_id])])
    return chosen.sort().values, counts


def extend_vocab(kept: torch.Tensor, counts: torch.Tensor, size: int,
                 eos_id: int | None) -> torch.Tensor:
    # kept [k] target ids of a warm-start head's draft vocabulary; counts [vocab] generated
    """-> [size] ascending target ids: every kept id, then the most generated others (EOS
    first if missing), so a warm-started head keeps what it learned and gains coverage."""
    if size < len(kept):
        raise ValueError(f"train-head: --draft-vocab {size} is smaller than the initial head's "
                         f"draft vocabulary ({len(kept)} tokens); use --draft-vocab >= {len(kept)}")
    taken = torch.zeros_like(counts, dtype=torch.bool)
    taken[kept] = True
    room = size - len(kept)
    extra = [] if eos_id is None or bool(taken[eos_id]) or room == 0 else [eos_id]
    taken[extra] = True
    order = torch.argsort(counts, descending=True, stable=True)
    fresh = order[~taken[order]][:room - len(extra)]
    return torch.cat([kept, torch.tensor(extra, dtype=torch.int64), fresh]).sort().values


def warm_start(head, start, vocab_rows: tuple[str, ...], layer_columns: str | None = None,
               mlp_rows: tuple[str, ...] = (), mlp_columns: tuple[str, ...] = ()) -> dict:
    """Copy `start`'s parameters into `head` (same kind and shapes); parameters with one row per
    draft token (`vocab_rows`) are remapped by target id, rows of tokens `start` lacked keep
    `head`'s own init. Where the heads read different target layers, the parameter with one
    column block per layer (`layer_columns`) is remapped by layer (`remap_layer_columns`).
    Where `head`'s MLP is wider, its hidden units' rows (`mlp_rows`) and columns
    (`mlp_columns`) are widened (`widen_units`). Where `head` has more decoder layers, the
    added ones (absent from `start`) keep their init with their output projections at zero
    (`deepen`). Returns counts for the recipe."""
    layers_old, layers_new = tuple(start.capture_layers), tuple(head.capture_layers)
    info = {}
    if layers_old != layers_new:
        if layer_columns is None or not set(layers_old) & set(layers_new):
            raise ValueError(f"train-head: --init-head reads target layers {list(layers_old)}, "
                             f"this run's head reads {list(layers_new)} (see --aux-layers)")
        info["layers_from"] = {"init_head": list(layers_old), "head": list(layers_new)}
    ids_new = head.draft_to_target(torch.arange(head.config.draft_vocab_size))
    ids_old = start.draft_to_target(torch.arange(start.config.draft_vocab_size))
    slot = torch.full((int(max(ids_new.max(), ids_old.max())) + 1,), -1, dtype=torch.int64)
    slot[ids_old] = torch.arange(len(ids_old))
    src_rows = slot[ids_new]  # [draft_vocab] row of `start` per new row, -1 when absent
    kept = src_rows >= 0
    old = dict(start.named_parameters())
    depth_old, depth_new = getattr(start, "num_layers", 1), getattr(head, "num_layers", 1)
    if depth_old > depth_new:
        raise ValueError(f"train-head: --init-head has {depth_old} decoder layers, this head "
                         f"{depth_new} (a head can only deepen: --head-layers >= {depth_old})")
    if depth_new > depth_old:
        info["layers_added"] = {"init_head": depth_old, "head": depth_new}
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name not in old:
                deepen(name, p)
            elif name in vocab_rows:
                p[kept] = old[name][src_rows[kept]].to(p.dtype)
            elif name == layer_columns and layers_old != layers_new:
                p.copy_(remap_layer_columns(old[name], layers_old, layers_new))
            elif name in mlp_rows + mlp_columns and tuple(old[name].shape) != tuple(p.shape):
                dim = 0 if name in mlp_rows else 1  # the hidden units' axis
                p.copy_(widen_units(p, old[name], dim, name))
                info["mlp_from"] = {"init_head": int(old[name].shape[dim]),
                                    "head": int(p.shape[dim])}
            elif tuple(old[name].shape) != tuple(p.shape):
                raise ValueError(f"train-head: --init-head's {name} has shape "
                                 f"{list(old[name].shape)}, this head needs {list(p.shape)}")
            else:
                p.copy_(old[name])
    return {"kept_vocab_rows": int(kept.sum()), "new_vocab_rows": int((~kept).sum()), **info}


# the parameters of an added decoder layer that write into the residual stream
LAYER_OUTPUTS = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


def deepen(name: str, p: torch.nn.Parameter) -> None:
    """A parameter of a decoder layer the warm start lacks (`layers.i.*`): its writes into the
    residual stream (`LAYER_OUTPUTS`) start at zero, so the deeper head computes what the start
    computed (each added layer passes its input through) and training grows the layer from
    there (its gradients flow: only its output weights are zero); the rest keep their init."""
    if not name.startswith("layers."):
        raise ValueError(f"train-head: --init-head has no {name} (not a head of this kind?)")
    if name.endswith(LAYER_OUTPUTS):
        p.zero_()


def head_depth(asked: int, kind, start, checkpoint: dict | None) -> int:
    """The head's decoder layers: those of the checkpoint a run resumes (another --head-layers
    is refused), else --head-layers, else --init-head's, else 1 (always, for a kind that does
    not stack layers)."""
    if not kind.deepens:
        return 1
    if checkpoint is not None:
        have = 1 + len({key.split(".")[1] for key in checkpoint["head"]
                        if key.startswith("layers.")})
        if asked and asked != have:
            raise ValueError(f"train-head: the checkpoint in --out has {have} decoder layers, "
                             f"--head-layers asks for {asked} (--fresh starts over)")
        return have
    if asked:
        return asked
    return int(getattr(start, "num_layers", 1)) if start is not None else 1


def widen_units(fresh: torch.Tensor, weight: torch.Tensor, dim: int, name: str) -> torch.Tensor:
    # fresh: the wider head's own init; weight: `start`'s, with fewer hidden units along `dim`
    """-> `fresh` with `weight` in its leading units. Along dim 0 (gate/up rows: what a unit
    reads) the added units keep their random init; along dim 1 (down columns: what a unit
    writes) they start at zero, so the wider MLP computes what `start`'s computed and training
    grows the added units from there (their gradients flow: the units are active, only their
    output weights are zero). Narrowing would drop trained units and is refused."""
    num_old, num_new = weight.shape[dim], fresh.shape[dim]
    other = [s for i, s in enumerate(weight.shape) if i != dim]
    if num_old > num_new or other != [s for i, s in enumerate(fresh.shape) if i != dim]:
        raise ValueError(f"train-head: --init-head's {name} has shape {list(weight.shape)}, this "
                         f"head needs {list(fresh.shape)} (an MLP can only widen: "
                         f"--head-intermediate >= {num_old})")
    out = fresh.detach().clone()
    if dim == 1:
        out[:, num_old:] = 0
    out.narrow(dim, 0, num_old).copy_(weight)
    return out


def mlp_width(asked: int, kind, start, checkpoint: dict | None) -> int | None:
    """The head's MLP width: that of the checkpoint a run resumes (a different --head-intermediate
    is refused), else --head-intermediate, else --init-head's, else None (the target's)."""
    if checkpoint is not None and kind.mlp_rows:
        have = int(checkpoint["head"][kind.mlp_rows[0]].shape[0])
        if asked and asked != have:
            raise ValueError(f"train-head: the checkpoint in --out has an MLP of {have} units, "
                             f"--head-intermediate asks for {asked} (--fresh starts over)")
        return have
    if asked:
        return asked
    return int(start.config.intermediate_size) if start is not None and kind.mlp_rows else None


def remap_layer_columns(weight: torch.Tensor, layers_old, layers_new) -> torch.Tensor:
    # weight [out, len(layers_old) * d]: column block i reads target layer layers_old[i]
    """-> [out, len(layers_new) * d]: each layer both heads read keeps its block; a layer only
    the new head reads starts at zero, so the warm-started head computes what `start` computed
    (bar the layers it no longer reads) and training adds the new layer's contribution."""
    d = weight.shape[1] // len(layers_old)
    blocks = {layer: weight[:, i * d:(i + 1) * d] for i, layer in enumerate(layers_old)}
    return torch.cat([blocks.get(layer, torch.zeros_like(weight[:, :d])) for layer in layers_new],
                     dim=1)


def quiet_rows(weight: torch.Tensor, new_rows: torch.Tensor, x: torch.Tensor,
               q: float = 0.01) -> torch.Tensor:
    # weight [V, d] LM-head rows; new_rows [V] bool; x [n, d] the head's normed outputs
    """-> [d] one row for tokens a warm-started head has never scored: along the mean output
    direction, scaled so its mean logit is the q-quantile of the kept tokens' logits. (Measured:
    the target's rows or zero rows for the 4,096 tokens added to the 8,192-token shipped head
    outscored its trained rows, held-out agreement 0.37 -> 0.00 / 0.15; the head's logits are
    mostly negative.) New tokens start unlikely and training lifts the ones the target uses."""
    u = x.float().mean(0)  # [d]
    kept_logits = (x.float() @ weight[~new_rows].float().T).flatten()
    sample = kept_logits[torch.randperm(len(kept_logits),
                                        generator=torch.Generator().manual_seed(0))[:1 << 20]]
    floor = float(torch.quantile(sample, q))
    return u * (floor / float(u @ u))


def coverage(ids: torch.Tensor, counts: torch.Tensor, size: int,
             target: float = 0.95) -> tuple[float, int | None]:
    # ids [n] held-out target tokens; counts [vocab] training counts
    """(share of `ids` among the `size` most frequent training tokens, the smallest such
    size reaching `target`, None if even every generated token does not)."""
    rank = torch.empty_like(counts)
    rank[torch.argsort(counts, descending=True, stable=True)] = torch.arange(len(counts))
    seen = counts[ids] > 0
    r = torch.where(seen, rank[ids], torch.full_like(ids, len(counts)))
    share = float((r < size).float().mean())
    needed = int(r.sort().values[math.ceil(target * len(r)) - 1]) + 1
    return round(share, 4), (needed if needed <= int((counts > 0).sum()) else None)


def lr_at(base_lr: float, step: int, progress: float) -> float:
    """Linear warm-up, then cosine decay to MIN_LR_FRACTION as progress goes 0 -> 1."""
    if step < WARMUP_STEPS:
        return base_lr * (step + 1) / WARMUP_STEPS
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return base_lr * (MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * cosine)


@torch.no_grad()
def heldout_metrics(head, rows: list[Row], layers, num_steps: int) -> dict:
    """Greedy drafting replayed on the target's greedy answers: per draft position j the
    share of verification steps whose first j+1 drafts all match the target, first-token
    agreement per category, expected accepted length (1 + mean accepted drafts) and the
    first tokens' agreement by the probability the head gave them."""
    runs, per_cat, first_probs, first_agree = [], {}, [], []
    for row in rows:
        alive = None
        run = torch.zeros(row.num_tokens, dtype=torch.long)
        for j, (h, idx, valid) in enumerate(unroll(head, row, layers, num_steps)):
            logits = head.draft_logits(h).float()  # [T, draft_vocab]
            col = logits.argmax(-1)  # [T]; the probability is read at the first position only
            agree = valid & (head.draft_to_target(col) == row.token_ids[row.shifted(2 + j)[0]])
            if j == 0:
                base = valid
                _add_by_category(per_cat, row, base, agree)
                alive = agree
                first_probs += torch.softmax(logits[base], dim=-1).gather(
                    -1, col[base][:, None])[:, 0].tolist()
                first_agree += agree[base].tolist()
            else:
                alive = alive & agree
            run += alive.long()
        runs.append(run[base])
    run = torch.cat(runs)
    positions = int(run.numel())
    per_pos = [round(float((run > j).float().mean()), 4) for j in range(num_steps)]
    return {"positions": positions, "first_token_agreement": per_pos[0],
            "acceptance_per_pos": per_pos,
            "expected_accepted_length": round(1 + float(run.float().mean()), 3),
            "per_category": {c: round(a / n, 4) for c, (a, n) in sorted(per_cat.items())},
            # the chain's prior for pricing the head before its live drafts (calibration.py)
            "first_token_calibration": first_token_table(first_probs, first_agree)}


def evaluate_saved_head(cfg, target, data) -> dict:
    """`heldout_metrics` of the head saved in cfg.out (`train-head --eval-only`)."""
    kind = HEAD_KINDS[cfg.kind]
    head = kind.load_head(cfg.out, target.config, TargetParts.of(target)).eval()
    rows = heldout_rows(data.heldout, data.heldout_categories, cfg.seq_len)
    return heldout_metrics(head, rows, head.capture_layers, cfg.ttt_steps)


def _add_by_category(per_cat: dict, row: Row, valid: torch.Tensor, agree: torch.Tensor) -> None:
    for doc, category in enumerate(row.categories or []):
        in_doc = row.doc_ids == doc
        a, n = per_cat.get(category, (0, 0))
        per_cat[category] = (a + int((agree & in_doc).sum()), n + int((valid & in_doc).sum()))


# ---- the run ----------------------------------------------------------------------------------

class HeadFit:
    """One training run: builds the draft vocabulary and the head (or resumes both from
    OUT/checkpoint.pt), trains until the step limit or time budget, saves."""

    def __init__(self, cfg, target, data, eos_id: int | None):
        self.cfg, self.data = cfg, data
        self.kind = HEAD_KINDS[cfg.kind]
        tc = target.config
        self.eps = tc.rms_norm_eps
        self.last_layer = tc.num_layers - 1
        parts = TargetParts.of(target)
        self.final_norm = parts.final_norm  # [d]
        generated = torch.cat([torch.roll(s.token_ids, -1)[s.next_is_output] for s in data.shards])
        ids, self.counts = draft_vocab(generated, cfg.draft_vocab, eos_id, tc.vocab_size)
        self.checkpoint = _read_checkpoint(cfg.out, cfg.kind) if not cfg.fresh else None
        start, self.warm_info, self.earlier_run = None, None, None
        if self.checkpoint is not None:
            ids = self.checkpoint["draft_ids"]
            # a resumed run keeps the lineage of the run that wrote the checkpoint
            self.earlier_run = _recipe_summary(cfg.out).get("recipe")
            self.warm_info = (self.earlier_run or {}).get("init_head")
        elif cfg.init_head:  # a warm start: its vocabulary kept, extended to --draft-vocab
            start = self.kind.load_head(cfg.init_head, tc, parts)
            kept = start.draft_to_target(torch.arange(start.config.draft_vocab_size))
            ids = extend_vocab(kept, self.counts, cfg.draft_vocab, eos_id)
        width = mlp_width(cfg.head_intermediate, self.kind, start, self.checkpoint)
        depth = head_depth(cfg.head_layers, self.kind, start, self.checkpoint)
        self.head = self.kind.new_head(cfg, tc, parts, ids, width, depth)
        if start is not None:
            self.warm_info = {"from": cfg.init_head, **_recipe_summary(cfg.init_head),
                              **warm_start(self.head, start, self.kind.vocab_rows,
                                            self.kind.layer_columns, self.kind.mlp_rows,
                                            self.kind.mlp_columns)}
            self._quiet_new_rows(start)
        self.label_head = parts.lm_head[ids].contiguous()  # [draft_vocab, d]
        self.layers = self.head.capture_layers
        self.heldout = heldout_rows(data.heldout, data.heldout_categories, cfg.seq_len)
        self.opt = torch.optim.AdamW(self.head.parameters(), lr=cfg.lr, betas=(0.9, 0.95),
                                     weight_decay=0.0)
        self.step, self.tokens, self.rows_drawn = 0, 0, 0
        if self.checkpoint is not None:
            self.head.load_state_dict(self.checkpoint["head"])
            self.opt.load_state_dict(self.checkpoint["opt"])
            self.step, self.tokens = self.checkpoint["step"], self.checkpoint["tokens"]
            self.rows_drawn = self.checkpoint["rows_drawn"]
        self.bf16 = bf16_matmul_is_fast() if cfg.train_dtype == "auto" else \
            cfg.train_dtype == "bfloat16"
        self.metrics_init = self.evaluate()
        self.train_info: dict = {}

    @torch.no_grad()
    def _quiet_new_rows(self, start) -> None:
        """Rows of the warm start's added tokens (EAGLE-3's trained LM head) start below the
        kept tokens (`quiet_rows`), measured on one training row at step 0."""
        if not self.kind.vocab_rows:
            return
        kept = torch.zeros(self.counts.shape[0], dtype=torch.bool)
        kept[start.draft_to_target(torch.arange(start.config.draft_vocab_size))] = True
        ids = self.head.draft_to_target(torch.arange(self.head.config.draft_vocab_size))
        new_rows = ~kept[ids]
        if not bool(new_rows.any()):
            return
        row = next(row_stream(self.data.shards, self.cfg.seq_len, self.cfg.seed + 1))
        h, _, valid = unroll(self.head, row, self.head.capture_layers, 1)[0]
        weight = self.head.lm_head.weight
        weight[new_rows] = quiet_rows(weight, new_rows, self.head.norm(h[valid]))

    def evaluate(self) -> dict:
        self.head.eval()
        metrics = heldout_metrics(self.head, self.heldout, self.layers, self.cfg.ttt_steps)
        self.head.train()
        return metrics

    def train(self) -> None:
        """AdamW steps until --steps or the time budget; Ctrl-C stops early and keeps what was
        learned; a checkpoint every CHECKPOINT_EVERY_S."""
        from tqdm import tqdm

        cfg = self.cfg
        rows = row_stream(self.data.shards, cfg.seq_len, cfg.seed, skip=self.rows_drawn)
        budget_s = cfg.time_budget_min * 60
        bar = tqdm(total=100, desc="train-head", unit="%", file=sys.stderr, dynamic_ncols=True,
                   bar_format="{l_bar}{bar}| {elapsed}<{remaining} {postfix}")
        t0 = last_ckpt = last_eval = time.perf_counter()
        steps0, history, stopped, held = self.step, [], "steps", self.metrics_init
        done = lambda: self.step - steps0  # noqa: E731  (steps of this run)

        def progress() -> float:  # 0 -> 1 towards whichever limit binds first
            by_steps = done() / cfg.steps if cfg.steps else 0.0
            by_time = (time.perf_counter() - t0) / budget_s if budget_s else 1.0
            return max(by_steps, by_time)

        try:
            while cfg.steps == 0 or done() < cfg.steps:
                elapsed = time.perf_counter() - t0
                if budget_s == 0 or (done() and elapsed * (done() + 1) / done() > budget_s):
                    stopped = "time budget"
                    break
                for group in self.opt.param_groups:
                    group["lr"] = lr_at(cfg.lr, done(), progress())
                batch = [next(rows) for _ in range(cfg.batch_size)]
                self.rows_drawn += len(batch)
                history.append(self._train_step(batch))
                self.step += 1
                self.tokens += sum(r.num_tokens for r in batch)
                now = time.perf_counter()
                if now - last_eval > EVAL_EVERY_S:
                    held, last_eval = self.evaluate(), now
                if now - last_ckpt > CHECKPOINT_EVERY_S:
                    self.save_checkpoint()
                    last_ckpt = now
                bar.n = min(100, round(100 * progress()))
                loss, acc = history[-1]
                bar.set_postfix_str(f"step {self.step} loss {loss:.3f} acc0 {acc:.3f} held-out "
                                    f"acc0 {held['first_token_agreement']}")
        except KeyboardInterrupt:
            stopped = "interrupted"
        bar.close()
        self.save_checkpoint()
        self.train_info = {
            "steps": self.step, "steps_this_run": done(), "tokens": self.tokens,
            "time_s": round(time.perf_counter() - t0, 1), "stopped_by": stopped,
            "resumed": self.checkpoint is not None, "ttt_steps": cfg.ttt_steps,
            "matmul_dtype": "bfloat16" if self.bf16 else "float32",
            "first_loss": _mean(history[:10]), "last_loss": _mean(history[-10:])}

    def _train_step(self, batch: list[Row]) -> tuple[float, float]:
        """One optimizer step over `batch` rows (gradients accumulated over the batch); returns
        (weighted loss per position, step-0 agreement with the target's argmax)."""
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
            unrolled = [unroll(self.head, row, self.layers, self.cfg.ttt_steps) for row in batch]
        counts = [max(1, sum(int(u[j][2].sum()) for u in unrolled))
                  for j in range(self.cfg.ttt_steps)]
        total, agree = torch.zeros(()), 0
        for row, steps in zip(batch, unrolled):
            probs = self._labels(row)  # [T, draft_vocab], zero rows where nothing is predicted
            for j, (h, idx, valid) in enumerate(steps):
                if not bool(valid.any()):
                    continue
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
                    logits = self.head.draft_logits(h[valid])  # [n, draft_vocab]
                p = probs[idx[valid]]
                if j == 0:
                    agree += int((logits.argmax(-1) == p.argmax(-1)).sum())
                total = total + STEP_WEIGHT ** j * soft_ce(logits.float(), p) / counts[j]
        total.backward()
        torch.nn.utils.clip_grad_norm_(self.head.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(total.detach()), agree / counts[0]

    @torch.no_grad()
    def _labels(self, row: Row) -> torch.Tensor:
        """[T, draft_vocab] target distributions (fp32) at the rows some step predicts from."""
        rows = row.has_feature & row.next_is_output
        probs = torch.zeros(row.num_tokens, self.head.config.draft_vocab_size)
        probs[rows] = target_probs(row.hidden[self.last_layer][rows], self.final_norm,
                                   self.label_head, self.eps, self.cfg.label_temperature)
        return probs

    def save_checkpoint(self) -> None:
        os.makedirs(self.cfg.out, exist_ok=True)
        path = os.path.join(self.cfg.out, CHECKPOINT)
        torch.save({"kind": self.cfg.kind, "head": self.head.state_dict(),
                    "opt": self.opt.state_dict(),
                    "step": self.step, "tokens": self.tokens, "rows_drawn": self.rows_drawn,
                    "draft_ids": self.head.draft_to_target(torch.arange(
                        self.head.config.draft_vocab_size))}, path + ".tmp")
        os.replace(path + ".tmp", path)

    def finish(self, command: str) -> dict:
        """Save the head (fp16, published layout) and return the recipe."""
        metrics = self.evaluate()
        size = self.head.save(self.cfg.out)
        held_ids = torch.roll(self.data.heldout.token_ids, -1)[self.data.heldout.next_is_output]
        # the share inside the head's own vocabulary (a warm start's or a checkpoint's is not
        # just the most generated tokens of this run's data); the size for 95% is this data's
        in_vocab = torch.zeros(len(self.counts), dtype=torch.bool)
        in_vocab[self.head.draft_to_target(torch.arange(self.head.config.draft_vocab_size))] = True
        share = round(float(in_vocab[held_ids.long()].float().mean()), 4)
        needed = coverage(held_ids.long(), self.counts, self.cfg.draft_vocab)[1]
        ever = round(float((self.counts[held_ids.long()] > 0).float().mean()), 4)

        return {
            "command": command,
            "config": dataclasses.asdict(self.cfg),
            "head": {"kind": self.cfg.kind, "file_mb": round(size / 1e6, 1),
                     "capture_layers": list(self.layers),
                     "parameters": sum(p.numel() for p in self.head.parameters()),
                     "embedding": "the target's (not stored)", **self.kind.describe(self.head)},
            "data": self.data.info,
            "draft_vocab": {"size": self.head.config.draft_vocab_size,
                            "heldout_coverage": share,
                            "tokens_for_95": needed, "heldout_tokens": int(held_ids.numel()),
                            "heldout_coverage_all_generated": ever,
                            "generated_distinct": int((self.counts > 0).sum())},
            "train": self.train_info,
            **({"init_head": self.warm_info} if self.warm_info else {}),
            **({"resumed_run": self.earlier_run} if self.earlier_run else {}),
            "heldout": dict(metrics, categories=self.data.heldout_categories and
                            sorted(set(self.data.heldout_categories)),
                            agreement_init=self.metrics_init["first_token_agreement"]),
        }


def bf16_matmul_is_fast() -> bool:
    """CPUs with AVX512-BF16 (or AMX) run bfloat16 matmuls ~3x faster than fp32 (measured here:
    77 vs 22 GFLOP/s on one contended core); elsewhere bf16 is emulated and slower."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _read_checkpoint(out: str, kind: str) -> dict | None:
    path = os.path.join(out, CHECKPOINT)
    if not os.path.exists(path):
        return None
    checkpoint = torch.load(path, weights_only=True)
    check_checkpoint_kind(checkpoint, kind, path)
    print(f"train-head: resuming from {path}", file=sys.stderr, flush=True)
    return checkpoint


def check_checkpoint_kind(checkpoint: dict, kind: str, path: str) -> None:
    """ValueError when the checkpoint holds another kind of head (checkpoints written before
    MTP training existed carry no kind: they are EAGLE-3's)."""
    found = checkpoint.get("kind", "eagle3")
    if found != kind:
        raise ValueError(f"train-head: {path} is a checkpoint of a {found} head, not {kind}; "
                         f"use another --out or --fresh")


def _recipe_summary(folder: str) -> dict:
    """What made a warm-start head (its recipe's command, data and held-out figures), so a
    head trained over several sessions keeps its whole lineage in recipe.json."""
    try:
        with open(os.path.join(folder, "recipe.json")) as f:
            recipe = json.load(f)
    except (OSError, ValueError):
        return {}
    keep = ("command", "data", "train", "heldout", "init_head", "resumed_run", "machine",
            "data_commands")
    return {"recipe": {k: recipe[k] for k in keep if k in recipe}}


def _mean(history: list[tuple[float, float]]) -> float | None:
    return round(sum(h[0] for h in history) / len(history), 4) if history else None
