"""`speculant demo`: one prompt, decoded plainly and speculatively, side by side.

Shows the text, tokens/s of both, the speed-up, and that the outputs are identical.
"""
from __future__ import annotations

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


def add_demo_args(p) -> None:
    p.add_argument("--prompt", default=None, help="user message (default: a code-edit task)")
    p.add_argument("--max-tokens", type=int, default=160)


def run_demo(args) -> int:
    from speculant.cli.options import engine_options
    from speculant.llm import LLM
    from speculant.engine.sampling_params import SamplingParams, SpecParams

    if args.spec_type in (None, "", "none"):
        args.spec_type = DEMO_SPEC
    t0 = time.perf_counter()
    llm = LLM(args.model, **engine_options(args, max_num_seqs=1))
    print(f"[speculant] loaded {llm.engine.model_path} in {time.perf_counter() - t0:.2f} s")
    prompt = llm.chat_prompt([args.prompt or DEMO_PROMPT])
    runs = {}
    for label, spec in (("plain", SpecParams(enabled=False)), (args.spec_type, SpecParams())):
        llm.engine.reset_stats()
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, spec=spec)
        out = llm.generate(prompt, params)[0]
        runs[label] = out
        print(f"\n=== {label}: {out.num_generated} tokens, {out.decode_tokens_per_s:.1f} tok/s decode, "
              f"mean accepted length {out.spec['mean_accepted_length'] or 1.0:.2f}\n{out.text}")
    plain, spec_out = runs["plain"], runs[args.spec_type]
    same = plain.token_ids == spec_out.token_ids
    speedup = spec_out.decode_tokens_per_s / plain.decode_tokens_per_s if plain.decode_tokens_per_s else 0
    print(f"\n[speculant] identical output: {'yes' if same else 'NO'}; "
          f"plain {plain.decode_tokens_per_s:.1f} tok/s, speculative "
          f"{spec_out.decode_tokens_per_s:.1f} tok/s -> {speedup:.2f}x")
    from speculant.cli.stats_table import format_speculator_table

    print(format_speculator_table(llm.engine.speculator_stats()))
    return 0 if same else 1

