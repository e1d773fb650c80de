"""The maths of recurrent layers, as pure functions of one sequence's run of tokens.

Two recurrences, each carrying a state from one forward to the next:

- the causal depthwise convolution (LFM2's short conv, DeltaNet's q|k|v conv): output t mixes
  inputs t-K+1..t, so the state is the *window* of the last W = K - 1 inputs, oldest first;
- the gated delta rule (Yang, Kautz, Hatamizadeh 2024, "Gated Delta Networks"): per value head a
  matrix state S [k_dim, v_dim]; each token decays it by exp(g), then writes the correction
  beta * (v - k^T S) along k (the delta rule), and reads q^T S.

Both can return the state after every token (`keep_steps`), which is what per-step snapshots
of a speculative round keep: accepting k tokens then selects step k, no recompute.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# Sequences longer than this run the chunked form of the delta rule (a few matmuls per 64
# tokens); shorter ones (decode and verification rows) the token-by-token recurrence.
CHUNK_SIZE = 64


def causal_conv(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, C] new inputs, window [C, W] the W previous inputs, weight [C, W + 1].

    Returns y [n, C] (y_t = sum_j weight[:, j] * input_{t - W + j}) and the padded inputs
    [C, W + n]; the window after token t is padded[:, t + 1 : t + 1 + W] (`conv_windows`).
    """
    padded = torch.cat([window, x.t()], dim=1)  # [C, W + n]
    y = F.conv1d(padded.unsqueeze(0), weight.unsqueeze(1), bias, groups=weight.shape[0])
    return y[0].t(), padded  # [n, C]


def conv_windows(padded: torch.Tensor, width: int) -> torch.Tensor:
    """[n, C, W]: the conv window after each of the n tokens of a `causal_conv` call."""
    return padded.unfold(1, width, 1)[:, 1:].permute(1, 0, 2)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    # as the FLA kernels (and transformers) compute it: x / sqrt(sum x^2 + eps)
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, state: torch.Tensor, keep_steps: bool = False):
    """One sequence's tokens through the gated delta rule.

    q, k [n, H, dk] (already l2-normalised, q scaled by dk^-0.5), v [n, H, dv], g [n, H] log
    decay (<= 0), beta [n, H] write strength in (0, 1), state [H, dk, dv] before token 0.
    Returns out [n, H, dv], the state after the last token [H, dk, dv], and with `keep_steps`
    the state after every token [n, H, dk, dv] (else None).
    """
    if keep_steps or q.shape[0] <= CHUNK_SIZE // 4:
        return _recurrent(q, k, v, g, beta, state, keep_steps)
    out, final = _chunked(q, k, v, g, beta, state)
    return out, final, None


def _recurrent(q, k, v, g, beta, state, keep_steps: bool):
    n = q.shape[0]
    out = v.new_empty(v.shape)  # [n, H, dv]
    steps = v.new_empty((n, *state.shape)) if keep_steps else None  # [n, H, dk, dv]
    s = state
    for t in range(n):
        s = s * g[t].exp()[:, None, None]
        remembered = (s * k[t][:, :, None]).sum(dim=1)  # [H, dv] = k^T S
        delta = (v[t] - remembered) * beta[t][:, None]  # the delta rule's correction
        s = s + k[t][:, :, None] * delta[:, None, :]
        out[t] = (s * q[t][:, :, None]).sum(dim=1)
        if steps is not None:
            steps[t] = s
    return out, s, steps


def _chunked(q, k, v, g, beta, state, chunk: int = CHUNK_SIZE):
    # The same recurrence in chunks (the WY/UT form of DeltaNet): within a chunk the delta-rule
    # writes are one triangular solve; the state is carried from chunk to chunk.
    n = q.shape[0]
    pad = (-n) % chunk
    # [H, num_chunks, chunk, d]; padding tokens have k = v = 0 and g = 0, so they change nothing
    q, k, v = (F.pad(x.transpose(0, 1), (0, 0, 0, pad)).unflatten(1, (-1, chunk))
               for x in (q, k, v))
    g, beta = (F.pad(x.t(), (0, pad)).unflatten(1, (-1, chunk)) for x in (g, beta))
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    cum = g.cumsum(dim=-1)  # [H, C, chunk] log decay from the chunk's start to each token
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    # decay[i, j] = exp(cum_i - cum_j) for j <= i (what token j's write has decayed by at i)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * decay  # unit lower-triangular once solved
    new_v = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cum = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False,
                                          unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay
    q_dec = q * cum.exp()[..., None]
    k_dec = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [H, C, 1, 1]
    out = torch.empty_like(v)
    s = state
    for c in range(q.shape[1]):
        v_c = new_v[:, c] - k_cum[:, c] @ s  # what the old state does not already predict
        out[:, c] = q_dec[:, c] @ s + attn[:, c] @ v_c
        s = s * chunk_decay[:, c] + k_dec[:, c].transpose(-1, -2) @ v_c
    return out.flatten(1, 2)[:, :n].transpose(0, 1), s
