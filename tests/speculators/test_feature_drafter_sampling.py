"""Rejection sampling with an EAGLE-3 head's own draft probabilities (temperature 1) emits
exactly the target's distribution: the joint law of the first two generated tokens, measured
over many seeded requests, is within a deviation bound of the target's exact law."""
import math

import torch

from conftest import TEST_THREADS
from speculant.cli.parity import prompt_logits
from speculant.engine.engine import Engine
from speculant.engine.sampling_params import SamplingParams, SpecParams
from speculant.models.eagle3_head import Eagle3Head

TOP_K = 4  # the target law has 4 x 4 cells: enough samples per cell for a sharp test
NUM_REQUESTS = 1600


def top_k_probs(logits: torch.Tensor) -> torch.Tensor:
    """The sampler's law at temperature 1 with top-k: softmax over the k largest logits."""
    vals, ids = logits.double().topk(TOP_K)
    return torch.zeros_like(logits, dtype=torch.float64).index_copy_(0, ids, torch.softmax(vals, 0))


def exact_joint(model, prompt_ids: list[int], kv_dtype: torch.dtype) -> dict[tuple[int, int], float]:
    """P(x_P = a, x_P+1 = b) of plain sampling, from the target's logits (with the engine's cache
    dtype and a marking the end of the prompt they are, bit for bit, the logits the engine
    samples from)."""
    p0 = top_k_probs(prompt_logits(model, prompt_ids, kv_dtype)[-1])
    joint = {}
    for a in p0.nonzero().flatten().tolist():
        p1 = top_k_probs(prompt_logits(model, prompt_ids + [a], kv_dtype, len(prompt_ids))[-1])
        for b in p1.nonzero().flatten().tolist():
            joint[(a, b)] = float(p0[a] * p1[b])
    return joint


def tv_bound(n: int, cells: int, delta: float = 1e-9) -> float:
    """TV distance an exact sampler exceeds with probability < delta (Weissman et al. 2003)."""
    return math.sqrt((cells * math.log(2) + math.log(1 / delta)) / (2 * n))


def sample_pairs(engine, prompt_ids, spec: SpecParams) -> dict[tuple[int, int], int]:
    counts: dict[tuple[int, int], int] = {}
    # max_tokens 3: the prefill emits x_P, then a one-token draft is verified for x_P+1
    seqs = [engine.add_request(prompt_ids, SamplingParams(max_tokens=3, temperature=1.0,
                                                          top_k=TOP_K, seed=seed, spec=spec))
            for seed in range(NUM_REQUESTS)]
    while engine.has_unfinished():
        engine.step()
    for seq in seqs:
        engine.release(seq)
        pair = tuple(seq.output_ids[:2])
        counts[pair] = counts.get(pair, 0) + 1
    return counts


def total_variation(counts: dict, joint: dict) -> float:
    n = sum(counts.values())
    cells = set(counts) | set(joint)
    return 0.5 * sum(abs(counts.get(c, 0) / n - joint.get(c, 0.0)) for c in cells)


def test_rejection_with_head_probabilities_preserves_the_target_law(tmp_path):
    """Drafts sampled from the head (q exposed) and verified by rejection sampling: the
    emitted pairs follow the target's exact joint law."""
    engine = Engine(model="default", num_threads=TEST_THREADS, max_num_seqs=64,
                    kv_cache_tokens=16384)
    # A short completion prompt: each request prefills it, and prefill is most of the cost.
    prompt_ids = engine.tokenizer.encode("Q: Name a fruit.\nA:")
    joint = exact_joint(engine.model, prompt_ids, engine.cache.k[0].dtype)
    # A head whose draft vocabulary is every token of the target's law (both positions): q is
    # spread over all of them while p puts each context's mass on 4, so drafts are accepted,
    # rejected and recovered often.
    support = sorted({t for pair in joint for t in pair})
    head = Eagle3Head.random(engine.model_config, support, seed=3)
    head.save(str(tmp_path), dtype=torch.float32)
    spec_engine = Engine(model="default", spec_type=["eagle3"], num_threads=TEST_THREADS,
                         max_num_seqs=64, kv_cache_tokens=16384, max_queue=NUM_REQUESTS,
                         spec_options={"eagle3": {"head": str(tmp_path), "temperature": 1.0}})
    spec_engine.chain.probe_interval = 0  # no back-off: a draft for every request
    counts = sample_pairs(spec_engine, prompt_ids, SpecParams(verify="rejection", n_max=1))
    stats = spec_engine.speculator_stats()["eagle3"]
    assert stats.num_draft_tokens > NUM_REQUESTS // 2  # the head drafted for most requests
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # both outcomes happened
    assert total_variation(counts, joint) < tv_bound(NUM_REQUESTS, len(joint))
