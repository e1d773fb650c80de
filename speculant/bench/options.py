"""`speculant bench` flags and their parsing (methods, concurrency levels, peers)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from urllib.parse import urlparse

from speculant.bench.interleave import DEFAULT_TURN_SECONDS
from speculant.bench.report import PLAIN, TUNED_SUFFIX
from speculant.engine.sampling_params import VERIFY_MODES

# A cell whose plain run took a few seconds is mostly noise on a shared 2-core VM: qa at c=8 (20
# prompts, 2.2 s of decoding per method, interleaved with the 4-layer draft) read 0.915x, 0.95x,
# 0.97x and 0.98x in four runs in a row (Intel Xeon with AMX, 2026-12-06), its five repeats in
# one run 0.958-1.024x. So short cells are repeated until plain was timed for this long.
DEFAULT_MIN_SECONDS = 8.0
DEFAULT_MAX_REPEATS = 5


def add_bench_args(p) -> None:
    g = p.add_argument_group("bench")
    g.add_argument("--prompts", default=None, help="JSONL prompt file (default: 8 built-in prompts)")
    g.add_argument("--categories", default=None, help="comma-separated categories of --prompts")
    g.add_argument("--limit", type=int, default=None, help="prompts per category")
    g.add_argument("--concurrency", default="1,8", help="comma-separated concurrency levels")
    g.add_argument("--max-tokens", type=int, default=128, help="tokens generated per prompt")
    g.add_argument("--repeats", type=int, default=1,
                   help="least repeats per measurement (median shown; see --min-seconds)")
    g.add_argument("--min-seconds", type=float, default=DEFAULT_MIN_SECONDS, metavar="S",
                   help="repeat a category x concurrency cell until plain decoding was timed for "
                        "at least S seconds in it, up to --max-repeats (0: exactly --repeats)")
    g.add_argument("--max-repeats", type=int, default=None, metavar="N",
                   help=f"most repeats of a cell with --min-seconds (default: "
                        f"{DEFAULT_MAX_REPEATS} or --repeats if more)")
    g.add_argument("--warmup-tokens", type=int, default=16,
                   help="tokens of the untimed warm-up run of each method (0: none)")
    g.add_argument("--verify", default="auto", choices=list(VERIFY_MODES))
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0, help="sampling: top-k (0: off)")
    g.add_argument("--top-p", type=float, default=1.0, help="sampling: top-p (1: off)")
    g.add_argument("--min-p", type=float, default=0.0, help="sampling: min-p (0: off)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="always generate --max-tokens (fixed-length decode measurement)")
    g.add_argument("--compare", default=None, metavar="PEERS",
                   help="peers measured in the same run, comma separated: hf, openai=URL")
    g.add_argument("--peer-repeats", type=int, default=None, metavar="N",
                   help="repeats of each --compare peer (default: --repeats)")
    g.add_argument("--hf-prompt-lookup", type=int, default=10, metavar="N",
                   help="prompt_lookup_num_tokens of the hf prompt-lookup peer (0: skip it)")
    g.add_argument("--openai-timeout", type=float, default=300.0, metavar="S",
                   help="seconds per request to an openai peer")
    g.add_argument("--rerun-on-interference", type=int, default=0, metavar="N",
                   help="re-run a measurement up to N times while other processes use the CPU")
    g.add_argument("--interference-tolerance", type=float, default=0.25, metavar="CORES",
                   help="average cores other processes may use before a run is flagged")
    g.add_argument("--record", default=None, metavar="FILE",
                   help="save the plain run's outputs as replay records (JSONL)")
    g.add_argument("--replay", default=None, metavar="RECORDS",
                   help="no model: replay recorded outputs through the --spec-type chains")
    g.add_argument("--replay-row-cost", type=float, default=None, metavar="C",
                   help="replay: what verifying one draft token costs, as a fraction of a plain "
                        "decode step (default: the engine's prior); prices drafts in the chain "
                        "and gives each row's est_speedup")
    g.add_argument("--tune-compare", action="store_true",
                   help="run every speculative method twice, without and with the online tuner "
                        "(the tuned one named METHOD+tuned), interleaved in the same run")
    g.add_argument("--interleave", action=argparse.BooleanOptionalAction, default=True,
                   help="one engine per method on the same loaded model, the methods run side "
                        "by side in turns of --interleave-seconds so that machine drift hits them "
                        "alike (default); --no-interleave runs them one after the other")
    g.add_argument("--interleave-seconds", type=float, default=DEFAULT_TURN_SECONDS, metavar="S",
                   help="length of one method's turn when interleaving (one step at least)")
    g.add_argument("--out-dir", default="bench_out", help="directory of the dated JSON and chart")
    g.add_argument("--json-out", default=None, help="also write the JSON result to this file")


@dataclass(slots=True)
class PeerSpec:
    kind: str  # "hf" | "openai"
    url: str | None = None


def parse_method_specs(spec_type: str, tune_compare: bool = False
                       ) -> list[tuple[str, list[str], dict]]:
    """'ngram_mod,suffix;draft' -> [('plain', [], {}), ('ngram_mod,suffix', [...], {}),
    ('draft', [...], {})]; with `tune_compare` each chain is followed by its tuned twin
    ('draft+tuned', ...). A chain may end in options of its own, `[TYPE.KEY=VALUE,...]`
    (`KEY=VALUE` when it has one speculator), so two settings of one speculator compare side
    by side: 'eagle3;eagle3[weights=q8_0]' -> [..., ('eagle3', ['eagle3'], {}),
    ('eagle3[weights=q8_0]', ['eagle3'], {'eagle3': {'weights': 'q8_0'}})]. A method named
    twice is refused (its runs would be one method's)."""
    methods = [(PLAIN, [], {})]
    for text in (spec_type or "none").split(";"):
        types, options, suffix = split_method(text)
        if types:
            name = ",".join(types) + suffix
            methods.append((name, types, options))
            if tune_compare:
                methods.append((name + TUNED_SUFFIX, types, options))
    names = [name for name, _, _ in methods]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"--spec-type: method {twice[0]!r} given twice")
    return methods


def split_method(text: str) -> tuple[list[str], dict, str]:
    """One `--spec-type` method -> (its speculators, its options {type: {key: value}}, the
    '[...]' suffix of its name, '' without options). ValueError names what is wrong."""
    from speculant.cli.options import parse_spec_options
    from speculant.engine.config import parse_spec_types
    from speculant.speculators.factory import speculator_config
    from speculant.speculators.registry import speculator_class

    chain, bracket, rest = text.strip().partition("[")
    types = parse_spec_types(chain)
    if not bracket:
        if "]" in text:
            raise ValueError(f"--spec-type: method {text.strip()!r}: ']' without '['")
        return types, {}, ""
    items = [item.strip() for item in rest[:-1].split(",") if item.strip()]
    if not rest.endswith("]") or "[" in rest or "]" in rest[:-1] or not items:
        raise ValueError(f"--spec-type: method {text.strip()!r}: options go in one [...] at "
                         f"its end, e.g. eagle3[weights=q8_0] or "
                         f"ngram_mod,suffix[ngram_mod.n_match=8,suffix.min_token_prob=0.2]")
    if not types:
        raise ValueError(f"--spec-type: method {text.strip()!r}: options need speculators "
                         f"before the [...]")
    named = []
    for item in items:
        if "." not in item.partition("=")[0]:
            if len(types) != 1:
                raise ValueError(f"--spec-type: method {text.strip()!r}: option {item!r} must "
                                 f"name its speculator (TYPE.KEY=VALUE) in a chain of "
                                 f"{len(types)}")
            item = f"{types[0]}.{item}"
        named.append(item)
    try:
        options = parse_spec_options(named)
    except ValueError as e:
        raise ValueError(f"--spec-type: method {text.strip()!r}: {e}") from None
    unknown = sorted(set(options) - set(types))
    if unknown:
        raise ValueError(f"--spec-type: method {text.strip()!r}: options for {unknown[0]!r}, "
                         f"which is not one of its speculators {types}")
    for name, opts in options.items():  # unknown keys and bad values, before any model loads
        try:
            speculator_config(speculator_class(name), opts)
        except (ValueError, TypeError) as e:
            raise ValueError(f"--spec-type: method {text.strip()!r}: {e}") from None
    return types, options, "[" + ",".join(items) + "]"


def merge_spec_options(base: dict, own: dict) -> dict:
    """The engine's speculator options with a method's own on top (per speculator, key by
    key)."""
    merged = {name: dict(opts) for name, opts in base.items()}
    for name, opts in own.items():
        merged.setdefault(name, {}).update(opts)
    return merged


def is_tuned(method: str) -> bool:
    return method.endswith(TUNED_SUFFIX)


def parse_levels(text: str) -> list[int]:
    try:
        levels = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise ValueError(f"--concurrency needs positive integers, got {text!r}")
    return levels


def parse_compare(value: str | None) -> list[PeerSpec]:
    """'hf,openai=http://127.0.0.1:8080' -> [PeerSpec('hf'), PeerSpec('openai', 'http://...')]."""
    peers = []
    for item in (value or "").split(","):
        kind, sep, url = item.strip().partition("=")
        if kind == "hf" and not sep:
            peers.append(PeerSpec("hf"))
        elif kind == "openai" and sep and _is_http_url(url):
            peers.append(PeerSpec("openai", url))
        elif item.strip():
            raise ValueError(f"--compare: unknown peer {item.strip()!r}; expected 'hf' or "
                             f"'openai=URL' (e.g. openai=http://127.0.0.1:8080)")
    if value is not None and not peers:
        raise ValueError("--compare: no peer given; expected 'hf' or 'openai=URL'")
    return peers


def wants_another_repeat(plain_decode_s: list[float], min_repeats: int, min_seconds: float,
                         max_repeats: int) -> bool:
    """Whether a cell runs one more repeat, given the decode seconds of plain's repeats so far:
    until `min_repeats`, then while they add up to less than `min_seconds`, up to `max_repeats`."""
    done = len(plain_decode_s)
    if done < min_repeats:
        return True
    return done < max_repeats and sum(plain_decode_s) < min_seconds


def _is_http_url(url: str) -> bool:
    parsed = urlparse(url)
    return parsed.scheme in ("http", "https") and bool(parsed.netloc)


def check_args(args) -> None:
    """Validate the bench flags (and default --peer-repeats and --max-repeats)."""
    if args.peer_repeats is None:
        args.peer_repeats = args.repeats
    if args.max_repeats is None:
        args.max_repeats = max(args.repeats, DEFAULT_MAX_REPEATS)
    for name, low in (("repeats", 1), ("peer_repeats", 1), ("max_tokens", 1), ("warmup_tokens", 0),
                      ("rerun_on_interference", 0), ("hf_prompt_lookup", 0), ("min_seconds", 0),
                      ("max_repeats", 1)):
        if not getattr(args, name) >= low:  # also refuses a NaN --min-seconds
            raise ValueError(f"--{name.replace('_', '-')} must be >= {low}")
    if args.max_repeats < args.repeats:
        raise ValueError(f"--max-repeats ({args.max_repeats}) must be >= --repeats "
                         f"({args.repeats})")
    from speculant.engine.sampling_params import SamplingParams

    try:
        SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                       min_p=args.min_p)
    except ValueError as e:  # e names the field: top_p must be in (0, 1], got 0.0
        raise ValueError(f"bad sampling flag (--temperature, --top-k, --top-p, --min-p): "
                         f"{e}") from None
    if args.replay and (args.compare or args.record or args.tune_compare):
        raise ValueError("--replay runs no model: --compare, --record and --tune-compare do not "
                         "apply")
    if args.interleave_seconds <= 0:
        raise ValueError(f"--interleave-seconds must be > 0, got {args.interleave_seconds}")
    if args.replay_row_cost is not None:
        if not args.replay:
            raise ValueError("--replay-row-cost applies only with --replay")
        if not 0.0 <= args.replay_row_cost < 1.0:
            raise ValueError(f"--replay-row-cost must be in [0, 1), got {args.replay_row_cost}")
