"""Human-readable table of per-speculator statistics (the end of a plain-text run)."""
from __future__ import annotations


def format_speculator_table(stats: dict, engine_stats=None) -> str:
    """`stats`: speculator name -> SpeculatorStats."""
    header = (f"{'speculator':<14} {'calls b/d/a':>14} {'drafts':>7} {'won':>6} {'acc.drafts':>10} "
              f"{'draft tok':>9} {'acc tok':>8} {'rate':>6} {'draft ms':>9}  accepted per position")
    lines = [header, "-" * len(header)]
    for name, s in stats.items():
        calls = f"{s.num_calls_begin}/{s.num_calls_draft}/{s.num_calls_accept}"
        per_pos = " ".join(str(n) for n in s.accepted_per_pos[:16])
        lines.append(
            f"{name:<14} {calls:>14} {s.num_proposals:>7} {s.num_drafts:>6} "
            f"{s.num_drafts_accepted:>10} {s.num_draft_tokens:>9} {s.num_accepted_tokens:>8} "
            f"{s.acceptance_rate:>6.2f} {1000 * s.time_draft_s:>9.1f}  {per_pos}")
    if engine_stats is not None and engine_stats.num_steps:
        e = engine_stats
        lines.append(f"engine: {e.num_steps} steps, {e.num_forward_tokens} forward tokens, "
                     f"draft {e.time_draft_s:.2f} s, forward {e.time_forward_s:.2f} s, "
                     f"verify {e.time_verify_s:.2f} s")
    return "\n".join(lines)
