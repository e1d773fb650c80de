"""The bench's paired bootstrap over prompts (bench/confidence.py) and its place in the report."""
import random
from types import SimpleNamespace as NS

import pytest

from speculant.bench.benchmark import _accepted_length_interval
from speculant.bench.confidence import (paired_ratio_interval, paired_repeats_interval,
                                        prompt_decode, prompt_decode_repeats, ratio_interval)
from speculant.bench.report import RunResult, build_report, markdown_table, paired_speedup

META = {"date": "2025-05-01T10:20:30+00:00", "elapsed_s": 1.0, "model": "/m/model.gguf",
        "dtype": "auto", "kv_dtype": "float16", "max_tokens": 64, "concurrency": [1],
        "repeats": 1, "min_seconds": 0.0, "max_repeats": 5, "interleave_s": 0.1,
        "peer_repeats": 1, "sampling": {}, "methods": ["plain", "suffix", "suffix+tuned"],
        "method_options": {}, "machine": {"cpu": "c", "num_cpus": 2, "threads": 2}}


def noisy_prompts(speedup: float, num_prompts: int, noise: float, seed: int):
    """Per prompt (tokens, seconds) of a base method and of one `speedup` times faster, each
    prompt's time moved by up to +-noise (the machine's drift while it ran)."""
    rng = random.Random(seed)
    base, other = [], []
    for _ in range(num_prompts):
        tokens = rng.randint(50, 255)
        seconds = tokens / 150.0
        base.append((tokens, seconds * (1 + rng.uniform(-noise, noise))))
        other.append((tokens, seconds / speedup * (1 + rng.uniform(-noise, noise))))
    return other, base


def test_the_interval_brackets_the_ratio_and_narrows_with_more_prompts():
    other, base = noisy_prompts(1.2, 40, 0.05, seed=1)
    point = (sum(t for t, _ in other) / sum(s for _, s in other)) / \
        (sum(t for t, _ in base) / sum(s for _, s in base))
    lo, hi = paired_ratio_interval(other, base)
    assert lo < point < hi and 1.1 < lo and hi < 1.3
    wide = paired_ratio_interval(other[:8], base[:8])
    assert wide[1] - wide[0] > hi - lo  # 8 prompts leave the ratio less sure than 40
    # noise-free prompts: every resample reads the same ratio
    exact = [(t, s / 1.5) for t, s in base]
    assert paired_ratio_interval(exact, base) == pytest.approx((1.5, 1.5))
    # an equal method: the interval holds 1
    same_lo, same_hi = paired_ratio_interval(*noisy_prompts(1.0, 40, 0.05, seed=2))
    assert same_lo < 1.0 < same_hi
    assert paired_ratio_interval(other, base) == (lo, hi)  # deterministic


def test_prompts_that_do_not_pair_give_no_interval():
    other, base = noisy_prompts(1.2, 10, 0.05, seed=3)
    assert paired_ratio_interval(other[:9], base) is None
    assert paired_ratio_interval(other[:1], base[:1]) is None
    # a prompt that never decoded (one token) is left out of both, not counted as infinitely fast
    other[0], base[0] = (0, 0.0), (0, 0.0)
    lo, hi = paired_ratio_interval(other, base)
    assert 1.1 < lo < hi < 1.3


def test_prompt_decode_sums_each_prompts_repeats():
    repeat_a = [NS(decode_only_tokens=10, decode_only_s=2.0), NS(decode_only_tokens=0, decode_only_s=0.0)]
    repeat_b = [NS(decode_only_tokens=10, decode_only_s=1.0), NS(decode_only_tokens=4, decode_only_s=0.5)]
    assert prompt_decode([repeat_a, repeat_b]) == [(20, 3.0), (4, 0.5)]
    assert prompt_decode([]) == []


def rate(prompts):
    return sum(t for t, _ in prompts) / sum(s for _, s in prompts)


def test_with_repeats_the_interval_is_of_the_median_of_the_paired_repeats():
    """Three repeats side by side where the method ran 1.2x its base twice and 0.9x once (the
    machine slowed it in that repeat only): the bench reports the median of the paired repeat
    ratios, 1.2, and the interval must be of that statistic: it holds 1.2, where the ratio
    pooled over the repeats (the summed lists) sits lower and its interval misses 1.2. One
    repeat each gives `paired_ratio_interval`'s interval exactly; repeats that do not pair up
    fall back to the pooled one."""
    other, base = noisy_prompts(1.2, 30, 0.03, seed=6)
    slow = [(t, s * 1.2 / 0.9) for t, s in other]  # the third repeat: 0.9x its base
    other_repeats, base_repeats = [other, other, slow], [base, base, base]
    point = paired_speedup([rate(o) for o in other_repeats], [rate(b) for b in base_repeats])
    lo, hi = paired_repeats_interval(other_repeats, base_repeats)
    assert lo <= point <= hi and point == pytest.approx(rate(other) / rate(base))
    summed = [(a + b + c, x + y + z) for (a, x), (b, y), (c, z) in zip(other, other, slow)]
    summed_base = [(3 * t, 3 * s) for t, s in base]
    pooled_lo, pooled_hi = paired_ratio_interval(summed, summed_base)
    assert pooled_hi < point  # what the report showed before: an interval beside its figure
    assert paired_repeats_interval([other], [base]) == paired_ratio_interval(other, base)
    assert paired_repeats_interval([other, slow], [base]) == \
        paired_ratio_interval([(a + b, x + y) for (a, x), (b, y) in zip(other, slow)], base)
    assert paired_repeats_interval([], [base]) is None
    assert paired_repeats_interval(other_repeats, base_repeats) == (lo, hi)  # deterministic


def test_prompt_decode_repeats_keeps_each_repeat_apart():
    repeat_a = [NS(decode_only_tokens=10, decode_only_s=2.0), NS(decode_only_tokens=0, decode_only_s=0.0)]
    repeat_b = [NS(decode_only_tokens=10, decode_only_s=1.0), NS(decode_only_tokens=4, decode_only_s=0.5)]
    assert prompt_decode_repeats([repeat_a, repeat_b]) == [[(10, 2.0), (0, 0.0)], [(10, 1.0), (4, 0.5)]]
    assert prompt_decode_repeats([]) == []


def test_the_reported_ratio_lies_inside_its_interval_with_repeats():
    """A tuned twin 1.1x in two repeats of three and 0.95x in the third: vs_untuned is the
    median of the repeats' ratios and vs_untuned_ci brackets it; the JSON carries both the
    summed and the per-repeat per-prompt lists."""
    untuned, _ = noisy_prompts(1.0, 25, 0.03, seed=7)
    tuned = [(t, s / 1.1) for t, s in untuned]
    tuned_slow = [(t, s / 0.95) for t, s in untuned]
    results = []
    for method, repeats in (("plain", [untuned] * 3), ("suffix", [untuned] * 3),
                            ("suffix+tuned", [tuned, tuned, tuned_slow])):
        r = cell(method, rate(repeats[0]), [(sum(p[i][0] for p in repeats),
                                             sum(p[i][1] for p in repeats))
                                            for i in range(25)])
        r.repeats_decode_tok_s = [rate(p) for p in repeats]
        r.prompt_decode_repeats = repeats
        results.append(r)
    report = build_report(dict(META), results, [])
    by = {r["method"]: r for r in report["results"]}
    t = by["suffix+tuned"]
    assert t["vs_untuned"] == pytest.approx(1.1, abs=1e-3)
    assert t["vs_untuned_ci"][0] <= t["vs_untuned"] <= t["vs_untuned_ci"][1]
    assert len(t["prompt_decode_repeats"]) == 3 and len(t["prompt_decode_repeats"][0]) == 25


def cell(method, rate, prompts):
    return RunResult(method=method, concurrency=1, category="qa", num_prompts=len(prompts),
                     prompt_tokens=100, generated_tokens=sum(t for t, _ in prompts),
                     prefill_tok_s=500.0, decode_tok_s=rate, e2e_tok_s=rate,
                     mean_accepted_length=1.0, acceptance_rate=0.0, draft_time_share=0.0,
                     repeats_decode_tok_s=[rate], prompt_decode=prompts)


def test_the_report_gives_each_method_its_interval_over_plain_and_the_untuned_twin():
    faster, plain = noisy_prompts(1.3, 30, 0.05, seed=4)
    tuned = [(t, s * 0.99) for t, s in faster]
    results = [cell("plain", 100.0, plain), cell("suffix", 130.0, faster),
               cell("suffix+tuned", 131.3, tuned)]
    report = build_report(dict(META), results, [])
    by = {r["method"]: r for r in report["results"]}
    assert by["plain"]["speedup_ci"] is None and by["plain"]["vs_untuned_ci"] is None
    lo, hi = by["suffix"]["speedup_ci"]
    assert 1.2 < lo < 1.3 < hi < 1.4
    assert by["suffix"]["vs_untuned_ci"] is None
    # tuned is the untuned twin 1% faster on every prompt: a narrow interval at 1/0.99
    assert by["suffix+tuned"]["vs_untuned_ci"] == pytest.approx([1 / 0.99, 1 / 0.99], abs=1e-3)
    assert len(by["suffix"]["prompt_decode"]) == 30  # the pairs any two methods resample
    assert paired_ratio_interval(by["suffix+tuned"]["prompt_decode"], by["suffix"]["prompt_decode"]) \
        == pytest.approx(by["suffix+tuned"]["vs_untuned_ci"], abs=2e-3)
    table = markdown_table(report)
    assert "speedup 95% CI" in table.splitlines()[0]
    assert f"{lo:.3f}-{hi:.3f}" in table and "1.010x (1.010-1.010)" in table


def test_the_accepted_length_has_its_interval_over_the_prompts():
    """1 + accepted / steps over the prompts resampled: it holds the run's figure, narrows when
    the prompts agree, and there is none without drafts."""
    def seq(accepted, steps, drafts=1):
        return NS(spec=NS(num_accepted_tokens=accepted, num_steps=steps, num_drafts=drafts))

    rng = random.Random(5)
    seqs = [seq(rng.randint(60, 200), 128) for _ in range(30)]
    point = 1 + sum(s.spec.num_accepted_tokens for s in seqs) / sum(s.spec.num_steps for s in seqs)
    lo, hi = _accepted_length_interval(seqs)
    assert lo < point < hi and hi - lo < 0.3
    assert _accepted_length_interval([seq(100, 100) for _ in range(5)]) == [2.0, 2.0]
    assert _accepted_length_interval([seq(0, 100, drafts=0) for _ in range(5)]) is None
    assert ratio_interval([(3, 0), (5, 10)]) is None  # one prompt with steps: no spread to read
