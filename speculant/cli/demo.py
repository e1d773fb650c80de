"""`speculant demo`: one prompt, decoded plainly and speculatively, side by side.

Shows the text, tokens/s of both, the speed-up, and that the outputs are identical.
"""
from __future__ import annotations

import os
import time

# A copy-heavy task the default 135M model does sensibly: most of the answer repeats the prompt,
# which is where model-free drafters shine.
DEMO_PROMPT = (
    "Correct the spelling mistakes in this paragraph and write the corrected paragraph:\n\n"
    "The quick brown fox jumpd over the lazy dog. It was a sunny day and the birds were singng "
    "in the trees. The fox was very hapy because he had found a big peice of cheese near the "
    "river. He carried it back to his den, where his three cubs were waiting for him. The cubs "
    "were hungry and they ate the cheese very quickley. After the meal, the whole famly went to "
    "sleep under the old oak tree at the edge of the forrest."
)
DEMO_SPEC = "ngram_mod,suffix"
# Open-ended chat: nothing to copy, the case a head reading the target's hidden states is for.
CHAT_PROMPT = "Explain why the sky is blue in three sentences."
CHAT_SPEC = "eagle3"


def add_demo_args(p) -> None:
    p.add_argument("--prompt", default=None, help="user message (default: a code-edit task)")
    p.add_argument("--max-tokens", type=int, default=160)


def demo_cases(args, eagle3_head: bool) -> list[tuple[str, list[str]]]:
    """(prompt, speculators) pairs: the given ones, or the copy task with the model-free chain
    and, when a head is shipped for the model, a chat prompt with eagle3."""
    from speculant.engine.config import parse_spec_types

    if args.spec_type not in (None, "", "none"):
        return [(args.prompt or DEMO_PROMPT, parse_spec_types(args.spec_type))]
    cases = [(args.prompt or DEMO_PROMPT, parse_spec_types(DEMO_SPEC))]
    if eagle3_head and args.prompt is None:
        cases.append((CHAT_PROMPT, [CHAT_SPEC]))
    return cases


def run_demo(args) -> int:
    from speculant.cli.options import engine_options
    from speculant.cli.stats_table import format_speculator_table
    from speculant.llm import LLM

    head = _has_shipped_head(args.model)
    cases = demo_cases(args, head)
    args.spec_type = ",".join(dict.fromkeys(t for _, types in cases for t in types))
    t0 = time.perf_counter()
    llm = LLM(args.model, **engine_options(args, max_num_seqs=1))
    print(f"[speculant] loaded {llm.engine.model_path} in {time.perf_counter() - t0:.2f} s")
    all_same = True
    for prompt, types in cases:
        all_same &= _side_by_side(llm, llm.chat_prompt([prompt]), types, args.max_tokens)
    print(format_speculator_table(llm.engine.speculator_stats()))
    return 0 if all_same else 1


def _side_by_side(llm, prompt: str, types: list[str], max_tokens: int) -> bool:
    from speculant.engine.sampling_params import SamplingParams, SpecParams

    label = ",".join(types)
    runs = {}
    for name, spec in (("plain", SpecParams(enabled=False)), (label, SpecParams(types=types))):
        llm.engine.reset_stats(speculators=False)
        out = llm.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, spec=spec))[0]
        runs[name] = out
        print(f"\n=== {name}: {out.num_generated} tokens, {out.decode_tokens_per_s:.1f} tok/s decode, "
              f"mean accepted length {out.spec['mean_accepted_length']:.2f} per step, "
              f"{out.spec['mean_accepted_length_per_draft']:.2f} per draft\n{out.text}")
    plain, spec_out = runs["plain"], runs[label]
    same = plain.token_ids == spec_out.token_ids
    speedup = spec_out.decode_tokens_per_s / plain.decode_tokens_per_s if plain.decode_tokens_per_s else 0
    print(f"\n[speculant] {label}: identical output: {'yes' if same else 'NO'}; "
          f"plain {plain.decode_tokens_per_s:.1f} tok/s, speculative "
          f"{spec_out.decode_tokens_per_s:.1f} tok/s -> {speedup:.2f}x")
    return same


def _has_shipped_head(model: str) -> bool:
    """Whether an EAGLE-3 head ships for this model (the default model's, once trained)."""
    from speculant.models.loader import resolve_model
    from speculant.speculators.eagle3 import Eagle3Speculator
    from speculant.speculators.feature_drafter import REPO_DIR

    name = Eagle3Speculator.shipped_heads.get(os.path.basename(resolve_model(model).path))
    return bool(name) and os.path.isfile(os.path.join(REPO_DIR, "drafts", name, "config.json"))
