"""Coupled drafts: a model drafter draws its token at draft position i with the filters and the
uniform the target will use there (`TargetDraws`), instead of taking its argmax.

Sample-and-match verification accepts a draft token when the target's own draw at that
position equals it. The target draws by inverse CDF in token-id order from its filtered
distribution p with the request's next uniform u; a drafter that draws from its own filtered
distribution q with the same u lands on the same token unless the two cumulative
distributions put u in different intervals, so acceptance approaches 1 as q approaches p,
whatever the entropy, where a greedy draft is accepted with p(argmax q) (at temperature 0.8,
often about half). The output is the target's draws either way: lossless by construction.

Drafters' columns must be in the target's token-id order (a reduced draft vocabulary sorted by
target id, as EAGLE-3's `d2t` builds it), so both walk the same order; tokens outside a reduced
vocabulary simply have no interval in q.
"""
from __future__ import annotations

import torch

from speculant.kernels.sample import native_sampling_fits, sample_rows_with_prob
from speculant.speculators.base import TargetDraws


def coupled_pick(logits: torch.Tensor,  # [C] a drafter's logits over its columns
                 draws: TargetDraws, position: int) -> tuple[int, float]:
    """The column drawn with the target's filters and its uniform at draft `position`, and that
    column's probability under the drafter's filtered distribution."""
    params = draws.params
    row = logits.float().reshape(1, -1).contiguous()  # [1, C]
    uniform = draws.uniforms(position + 1)[position:position + 1]  # [1]
    if native_sampling_fits(row):
        cols, probs = sample_rows_with_prob(row, uniform, temperature=params.temperature,
                                            top_k=params.top_k, top_p=params.top_p,
                                            min_p=params.min_p)
        return int(cols[0]), float(probs[0])
    from speculant.engine.sampler import filter_probs  # the PyTorch pipeline (other devices)

    filtered = filter_probs(row, params)
    col = int(filtered.sample(uniform.to(row.device))[0])
    return col, float(filtered.to_dense(row.shape[1])[0, col])
