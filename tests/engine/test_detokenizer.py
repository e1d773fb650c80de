"""Incremental detokenization: the same text as a full decode, stop strings, bounded work."""
import random

import pytest

from speculant.engine.detokenizer import Detokenizer

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Ünïcödé: 日本語のテキスト, emoji 🎉🚀 and math ∑x² — done.",
    "def f(x):\n    return x * 2  # comment\n\n\nprint(f(3))",
    "   leading spaces and\ttabs\r\nand CRLF",
]


@pytest.fixture(scope="module")
def tokenizer():
    from speculant.models.loader import resolve_model
    from speculant.models.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model("default"))


def push_all(tokenizer, ids, stop=()):
    detok = Detokenizer(tokenizer, stop)
    pieces = []
    for i, t in enumerate(ids):
        piece, hit = detok.push(t)
        pieces.append(piece)
        if hit is not None:
            return detok, "".join(pieces), i, hit
    pieces.append(detok.flush())
    return detok, "".join(pieces), None, None


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_concatenate_to_the_full_decode(tokenizer, text):
    """Text pushed token by token equals decode(all ids), multi-byte characters included."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok, joined, _, _ = push_all(tokenizer, ids)
    assert joined == tokenizer.decode(ids) == detok.text


def test_random_ids_match_the_full_decode(tokenizer):
    """Arbitrary ids (byte tokens that split characters, special tokens) decode identically."""
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 60))]
        assert push_all(tokenizer, ids)[1] == tokenizer.decode(ids)


@pytest.mark.parametrize("stop,cut", [
    (["fox"], "Hello, world! The quick brown "),
    (["world", "Hello"], ""),  # the stop that ends first wins
    (["lazy dog", "o"], "Hell"),
    (["absent"], None),
])
def test_stop_string_cuts_the_text_before_it(tokenizer, stop, cut):
    ids = tokenizer.encode(TEXTS[0], add_special_tokens=False)
    detok, joined, at, hit = push_all(tokenizer, ids, stop)
    if cut is None:
        assert hit is None and joined == TEXTS[0]
        return
    assert detok.text == cut and joined.startswith(cut) and hit.text_len == len(cut)
    assert tokenizer.decode(ids[:at + 1]).startswith(cut)  # the token completing the stop
    assert not any(s in tokenizer.decode(ids[:at]) for s in stop)  # ... and not the one before


def test_stop_string_spanning_many_tokens(tokenizer):
    ids = tokenizer.encode("alpha beta gamma delta epsilon", add_special_tokens=False)
    detok, joined, _, hit = push_all(tokenizer, ids, ["gamma delta"])
    assert detok.text == "alpha beta " and hit.text_len == len(detok.text)
    assert joined.startswith("alpha beta gamma")  # streamed pieces: the server holds this back


def test_work_per_token_does_not_grow_with_the_output(tokenizer):
    """A 4000-token output with stop strings: tokens decoded per pushed token stay bounded
    and are the same at the start and the end (no decode from the start of the output)."""
    text = " ".join(f"word{i} 日本 🎉" for i in range(1500))
    ids = tokenizer.encode(text, add_special_tokens=False)[:4000]
    assert len(ids) == 4000
    detok = Detokenizer(tokenizer, ["NEVER-APPEARS", "also absent", "x" * 40])
    per_push = []
    for t in ids:
        before = detok.num_decoded_tokens
        detok.push(t)
        per_push.append(detok.num_decoded_tokens - before)
    assert max(per_push) <= 4 * 8  # a window of a few tokens, whatever the output length
    first, last = sum(per_push[:1000]), sum(per_push[-1000:])
    assert abs(first - last) <= 0.2 * first
    assert detok.text == tokenizer.decode(ids)


@pytest.mark.slow
def test_engine_stream_of_4000_tokens_decodes_a_bounded_window_per_step(default_engine):
    """End to end: a 4000-token generation with stop strings; the tokens the detokenizer
    decodes per generated token are the same over the first and the last thousand."""
    from speculant.engine.sampling_params import SamplingParams

    engine = default_engine
    params = SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True,
                            stop=["NEVER-APPEARS", "also absent"])
    seq = engine.add_request("Count from one to ten thousand: one, two, three,", params)
    marks = []  # (tokens generated, tokens decoded so far)
    while engine.has_unfinished():
        engine.step()
        marks.append((seq.num_generated, seq.detokenizer.num_decoded_tokens))
    engine.release(seq)
    assert seq.num_generated == 4000

    def decoded_between(lo, hi):
        at = lambda n: next(d for g, d in marks if g >= n)  # noqa: E731
        return at(hi) - at(lo)

    first, last = decoded_between(100, 1100), decoded_between(2900, 3900)
    assert last <= 1.25 * first and last <= 40 * 1000  # not growing with the output
