"""Options shared by the commands: engine and sampling flags, and their translation to configs.

Flag defaults and choices come from the config dataclasses (`EngineConfig`, `SamplingParams`,
`SpecParams`), so a default is stated once. Every command imports this module; nothing here
imports a command (no cycles).
"""
from __future__ import annotations

import argparse
import dataclasses

from speculant.engine.config import EngineConfig, parse_spec_types
from speculant.engine.kv_cache import KV_DTYPES
from speculant.engine.sampling_params import VERIFY_MODES, SamplingParams, SpecParams
from speculant.engine.state_checkpoint import CKPT_MODES
from speculant.models.loader import DTYPES


def config_default(cls, name: str):
    """The default of dataclass field `name` of `cls` (one place for every flag's default)."""
    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory()


def add_engine_args(p: argparse.ArgumentParser) -> None:
    d = lambda name: config_default(EngineConfig, name)  # noqa: E731
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=d("model"), help="GGUF file, HF folder, or 'default' (SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default=d("dtype"), choices=list(DTYPES),
                   help="weights: auto keeps GGUF quantization; float32 inflates to fp32")
    g.add_argument("--threads", type=int, default=d("num_threads"), help="torch threads (default: all cores)")
    g.add_argument("--max-model-len", type=int, default=d("max_model_len"), help="context length cap")
    g.add_argument("--kv-cache-tokens", type=int, default=d("kv_cache_tokens"), help="KV cache capacity in tokens")
    g.add_argument("--kv-dtype", default=d("kv_dtype"), choices=["auto", *KV_DTYPES],
                   help="KV cache element type: float16 halves its memory and attention's reads; "
                        "bfloat16 (CPUs with avx512_bf16) is attended on AMX-BF16 tiles or "
                        "AVX512_BF16 dot products, every position alike; auto = float32 with "
                        "--dtype float32, else bfloat16 where the CPU has avx512_bf16, else "
                        "float16")
    g.add_argument("--max-num-batched-tokens", type=int, default=d("max_num_batched_tokens"),
                   help="tokens per forward")
    s = p.add_argument_group("speculation")
    s.add_argument("--spec-type", default="none",
                   help="speculators, comma separated: ngram_simple,ngram_map_k,ngram_map_k4v,"
                        "ngram_mod,ngram_cache,suffix,draft,eagle3,mtp (or 'none'); bench "
                        "takes several methods separated by ';', each optionally with options "
                        "of its own: 'eagle3;eagle3[weights=q8_0]'")
    s.add_argument("--spec-n-max", type=int, default=d("spec_n_max"), help="longest draft")
    s.add_argument("--spec-n-min", type=int, default=d("spec_n_min"), help="drop drafts shorter than this")
    s.add_argument("--spec-p-min", type=float, default=d("spec_p_min"), help="stop drafting below this confidence")
    s.add_argument("--draft-model", default=None, help="draft model for --spec-type draft")
    s.add_argument("--spec-option", action="append", default=[], metavar="TYPE.KEY=VALUE",
                   help="speculator option, e.g. ngram_mod.n_match=16 (repeatable)")
    s.add_argument("--spec-params", default=None, metavar="FILE",
                   help="draft limits found by `speculant tune` for this --spec-type (flags given "
                        "explicitly win)")
    s.add_argument("--spec-tune", action="store_true",
                   help="tune the draft limit online from measured tokens/s (0 = plain decoding "
                        "where speculation does not pay); requests with their own n_max are not tuned")
    s.add_argument("--spec-synth-rates", default=None, metavar="R1,R2,...",
                   help="synthetic acceptance per draft position (benchmarking; output invalid)")
    s.add_argument("--spec-ckpt-mode", default=d("spec_ckpt_mode"),
                   choices=["auto", *CKPT_MODES],
                   help="hybrid models: per_step state snapshots, or reeval (restore + re-run)")


def engine_options(args, max_num_seqs: int) -> dict:
    """EngineConfig keyword arguments from parsed engine flags (the model is passed apart).

    Flags that configure one speculator become its options: `--draft-model P` is
    `draft.model=P`, `--spec-synth-rates R` adds `synthetic` with `synthetic.rates=R`."""
    spec_type = parse_spec_types(args.spec_type)
    spec_options = parse_spec_options(args.spec_option)
    if args.draft_model:
        spec_options.setdefault("draft", {}).setdefault("model", args.draft_model)
    if args.spec_synth_rates:
        spec_options.setdefault("synthetic", {})["rates"] = parse_rates(args.spec_synth_rates)
        if "synthetic" not in spec_type:
            spec_type.append("synthetic")
    n_max, p_min = tuned_limits(args, spec_type)
    return dict(
        dtype=args.dtype, num_threads=args.threads, max_model_len=args.max_model_len,
        kv_cache_tokens=args.kv_cache_tokens, kv_dtype=args.kv_dtype,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=max_num_seqs, spec_type=spec_type,
        spec_n_max=n_max, spec_n_min=args.spec_n_min, spec_p_min=p_min,
        spec_options=spec_options, spec_tune=args.spec_tune, spec_ckpt_mode=args.spec_ckpt_mode,
    )


def tuned_limits(args, spec_type: list[str]) -> tuple[int, float]:
    """(n_max, p_min): the flags, or what `--spec-params FILE` holds for this chain where the
    flags were left at their defaults."""
    n_max, p_min = args.spec_n_max, args.spec_p_min
    if not getattr(args, "spec_params", None) or not spec_type:
        return n_max, p_min
    from speculant.engine.spec_params import read_spec_params, setting_for

    setting = setting_for(read_spec_params(args.spec_params), spec_type)
    if setting is None:
        return n_max, p_min
    if n_max == config_default(EngineConfig, "spec_n_max"):
        n_max = setting.spec_n_max
    if p_min == config_default(EngineConfig, "spec_p_min"):
        p_min = setting.spec_p_min
    return n_max, p_min


def parse_rates(text: str) -> list[float]:
    """'0.9,0.5' -> [0.9, 0.5]; ValueError names the flag."""
    try:
        return [float(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--spec-synth-rates: expected numbers like 0.9,0.5, got {text!r}") from None


def parse_spec_options(items: list[str]) -> dict:
    """['ngram_mod.n_match=16'] -> {'ngram_mod': {'n_match': 16}}; ValueError names a bad item."""
    out: dict[str, dict] = {}
    for item in items:
        key, sep, value = item.partition("=")
        name, dot, field = key.partition(".")
        if not sep or not dot or not name or not field:
            raise ValueError(f"--spec-option {item!r}: expected TYPE.KEY=VALUE")
        out.setdefault(name.replace("-", "_"), {})[field] = _literal(value)
    return out


def _literal(value: str):
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(value.lower(), value)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    d = lambda name: config_default(SamplingParams, name)  # noqa: E731
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=d("max_tokens"))
    # The CLI is greedy by default (the API's default temperature is OpenAI's 1.0).
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=d("top_k"))
    g.add_argument("--top-p", type=float, default=d("top_p"))
    g.add_argument("--min-p", type=float, default=d("min_p"))
    g.add_argument("--repeat-penalty", type=float, default=d("repetition_penalty"))
    g.add_argument("--seed", type=int, default=d("seed"))
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="generate max_tokens regardless of EOS")
    g.add_argument("--verify", default=config_default(SpecParams, "verify"), choices=list(VERIFY_MODES),
                   help="verification: auto = greedy at temperature 0, else sample-and-match")


def sampling_params(args, **over) -> SamplingParams:
    """SamplingParams from parsed sampling flags; keyword arguments override single fields."""
    spec = SpecParams(verify=args.verify)
    kw = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
              top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repeat_penalty,
              seed=args.seed, stop=list(args.stop), ignore_eos=args.ignore_eos, spec=spec)
    kw.update(over)
    return SamplingParams(**kw)
