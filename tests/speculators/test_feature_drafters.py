"""The feature drafters (eagle3, mtp): exact outputs with any head, the paged head equals the
head's own causal maths, heads load from every supported layout, heads that do not fit are
refused at load."""
import contextlib

import pytest
import torch
import torch.nn.functional as F

from conftest import TEST_THREADS, decode_all
from speculant.engine.engine import Engine
from speculant.engine.sampling_params import SamplingParams, SpecParams
from speculant.models.eagle3_head import Eagle3Head, run_layers
from speculant.models.mtp_head import MtpHead
from speculant.kernels.kv_layout import gather_k, gather_v

PROMPTS = ["Write a haiku about the sea.", "List four prime numbers.",
           "Explain in one sentence what a compiler does.", "Say hello in French and Spanish."]


@pytest.fixture(scope="module")
def target_config():
    from speculant.models.loader import load_model

    return load_model("default", "auto").config


def random_head(kind, target):
    if kind == "eagle3":
        return Eagle3Head.random(target, torch.arange(0, target.vocab_size, 7), seed=1)
    return MtpHead.random(target, seed=1)


@pytest.fixture(scope="module", params=["eagle3", "mtp"])
def kind(request):
    return request.param


@pytest.fixture(scope="module")
def random_head_dir(kind, target_config, tmp_path_factory):
    """A randomly initialised head for the default model, in its published layout."""
    path = str(tmp_path_factory.mktemp(f"{kind}_head"))
    random_head(kind, target_config).save(path, dtype=torch.float32)
    return path


@pytest.fixture(scope="module")
def eagle_engine(kind, random_head_dir):
    return Engine(model="default", spec_type=[kind],
                  spec_options={kind: {"head": random_head_dir, "kv_dtype": "float32"}},
                  max_num_seqs=4, num_threads=TEST_THREADS, kv_cache_tokens=8192)


def chats(engine, prompts):
    return [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]


@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_output_equals_plain(eagle_engine, batch):
    """Whatever the head drafts, greedy speculative output equals plain decoding."""
    prompts = chats(eagle_engine, PROMPTS)
    plain = decode_all(eagle_engine, prompts, SamplingParams(max_tokens=32, temperature=0.0,
                                                             spec=SpecParams(enabled=False)), batch)
    probe = eagle_engine.speculator(eagle_engine.speculator_names[0])
    probe_forwards = probe.num_draft_forwards
    eagle_engine.chain.probe_interval = 0  # no back-off: the random head's drafts are verified
    try:
        spec = decode_all(eagle_engine, prompts, SamplingParams(max_tokens=32, temperature=0.0,
                                                                spec=SpecParams(n_max=3)), batch)
    finally:
        eagle_engine.chain.probe_interval = 16
    assert [s.output_ids for s in spec] == [s.output_ids for s in plain]
    assert sum(s.spec.num_draft_tokens for s in spec) > 0
    assert probe.num_draft_forwards > probe_forwards
    assert eagle_engine.stats.num_speculator_errors == 0  # no draft round was dropped


def test_seeded_sampling_equals_plain(eagle_engine):
    """Sampled drafts with q exposed: match-verification at temperature 1 reproduces plain
    decoding with the same seed token for token."""
    prompts = chats(eagle_engine, PROMPTS[:2])
    params = dict(max_tokens=24, temperature=1.0, seed=5)
    plain = decode_all(eagle_engine, prompts, SamplingParams(**params, spec=SpecParams(enabled=False)))
    spec = decode_all(eagle_engine, prompts, SamplingParams(**params, spec=SpecParams(verify="match")))
    assert [s.output_ids for s in spec] == [s.output_ids for s in plain]


def test_a_sampling_targets_draft_tokens_are_drawn_with_its_uniforms(eagle_engine, kind):
    """Where the target samples, the head draws its token at draft position i with the target's
    filters and the uniform the target will use there (coupled.py): the same draw as the
    target's sampler on these logits, mapped through the draft vocabulary; a greedy row keeps
    its argmax, and peeking leaves the request's stream where it was."""
    from speculant.engine.sampler import Sampler
    from speculant.speculators.base import TargetDraws

    spec = eagle_engine.speculator(kind)
    ids = spec._draft_id_list
    logits = torch.randn(3, len(ids), generator=torch.Generator().manual_seed(0)) * 3
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7)
    sampler = Sampler(params, len(ids))  # a sampler over the draft's columns, for the expected
    uniforms = sampler.peek_uniforms(3)
    picks = spec._pick(logits, [(TargetDraws(params, sampler), 0), (None, 0),
                                (TargetDraws(params, sampler), 2)])
    assert picks[0][0] == ids[sampler.sample_ids(logits[0:1], [], uniforms[0:1])[0]]
    assert picks[2][0] == ids[sampler.sample_ids(logits[2:3], [], uniforms[2:3])[0]]
    assert picks[1][0] == ids[int(logits[1].argmax())]
    assert all(0.0 < p <= 1.0 and q is None for _, p, q in picks)
    assert sampler.draw_uniforms(3).equal(uniforms)


def reference_first_draft(head, features: dict, token_ids: list[int]) -> int:
    """The head's first draft token by its own maths: fc over the target's features of
    positions 0..N-1, tokens 1..N, one causal attention over the whole sequence."""
    raw = torch.cat([features[i] for i in head.capture_layers], dim=-1)  # [N, n_feat * d]
    hidden = head.fuse(raw)
    ids = torch.tensor(token_ids[1:])
    pos = torch.arange(len(ids))

    def attend(layer, q, k, v):  # every layer: causal over the whole sequence, its own keys
        q, k = head.apply_rope(q, pos), head.apply_rope(k, pos)
        group = q.shape[1] // k.shape[1]
        attn = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.repeat_interleave(group, 1).transpose(0, 1),
            v.repeat_interleave(group, 1).transpose(0, 1), is_causal=True).transpose(0, 1)
        return attn.reshape(len(ids), -1)

    h_out = run_layers(head, head.embed(ids), hidden, attend)
    col = int(head.draft_logits(h_out[-1:]).argmax())
    return int(head.draft_to_target(torch.tensor(col)))


@contextlib.contextmanager
def first_drafts(probe):
    """-> a list that collects (token ids, first draft token) per request `probe` drafts for."""
    drafted = []
    original = probe.draft

    def spy(requests):
        out = original(requests)
        drafted.extend((list(r.token_ids), out[r.seq_id].token_ids[0]) for r in requests
                       if r.seq_id in out)
        return out

    probe.draft = spy
    try:
        yield drafted
    finally:
        probe.draft = original


@torch.inference_mode()
def test_paged_drafting_equals_the_heads_causal_maths(eagle_engine):
    """The first draft token after the prompt is the one the head's full-sequence forward
    gives on the same target features (alignment of features, tokens, positions, cache)."""
    from speculant.llm import LLM

    engine = eagle_engine
    engine.reset_stats()  # fresh speculators: no learned back-off from earlier tests
    probe = engine.speculator(engine.speculator_names[0])
    llm = LLM.from_engine(engine)
    prompt = chats(engine, ["Name a colour."])[0]
    seq = engine.add_request(prompt, SamplingParams(max_tokens=3, temperature=0.0,
                                                    spec=SpecParams(n_max=1)))
    with first_drafts(probe) as drafted:
        while engine.has_unfinished():
            engine.step()
    engine.release(seq)
    assert drafted, "the head never drafted"
    history, first = drafted[0]
    features = llm.hidden_states(history[:-1], probe.hidden_layers)
    assert first == reference_first_draft(probe.head, features, history)


def assert_greedy_spec_equals_plain(engine, prompts, max_tokens: int, n_max: int) -> None:
    """Greedy outputs with drafts of up to `n_max` tokens equal those of plain decoding."""
    spec = decode_all(engine, prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                      spec=SpecParams(n_max=n_max)))
    plain = decode_all(engine, prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                       spec=SpecParams(enabled=False)))
    assert [s.output_ids for s in spec] == [s.output_ids for s in plain]


def engine_with_head(path: str, head: Eagle3Head) -> Engine:
    """A 2-sequence engine drafting with `head`, saved (fp32) to `path` first."""
    head.save(path, dtype=torch.float32)
    return Engine(model="default", spec_type=["eagle3"],
                  spec_options={"eagle3": {"head": path, "kv_dtype": "float32"}},
                  max_num_seqs=2, num_threads=TEST_THREADS, kv_cache_tokens=2048)


@torch.inference_mode()
def test_a_head_reading_four_layers_up_to_the_last_drafts_from_them(tmp_path, target_config):
    """An EAGLE-3 head may read more than three layers and the last layer's output (aux id L,
    speculant's extension): the engine captures all four, its first draft is the head's own
    maths on them, and greedy output still equals plain."""
    from speculant.llm import LLM

    path = str(tmp_path / "head4")
    aux = (2, 15, 27, target_config.num_layers)
    engine = engine_with_head(path, Eagle3Head.random(
        target_config, torch.arange(0, target_config.vocab_size, 7), seed=3, aux_layer_ids=aux))
    probe = engine.speculator("eagle3")
    assert probe.hidden_layers == (1, 14, 26, target_config.num_layers - 1)
    engine.chain.probe_interval = 0
    prompt = chats(engine, ["Name a colour."])[0]
    with first_drafts(probe) as drafted:
        assert_greedy_spec_equals_plain(engine, [prompt], max_tokens=12, n_max=2)
    assert drafted, "the head never drafted"
    history, first = drafted[0]
    features = LLM.from_engine(engine).hidden_states(history[:-1], probe.hidden_layers)
    assert first == reference_first_draft(probe.head, features, history)


@torch.inference_mode()
def test_lazy_entries_catch_up_to_the_heads_causal_maths(eagle_engine):
    """Committed tokens only keep their features: once the head drafts for a sequence, it runs
    no forward per step until PENDING_LIMIT entries wait (then one batched forward) or a draft
    is asked for, and the draft after the catch-up is the head's own full-sequence answer."""
    from speculant.llm import LLM
    from speculant.speculators.base import CommittedTokens, DraftParams, DraftRequest
    from speculant.speculators.feature_drafter import PENDING_LIMIT

    engine = eagle_engine
    probe = engine.speculator(engine.speculator_names[0])
    tok = engine.tokenizer
    history = tok.encode(chats(engine, ["Name a colour."])[0]) + tok.encode(
        " Blue is the colour of a clear sky at noon, of deep water far from the shore, and "
        "of many flags. Painters mix it with yellow to make green and with red to make "
        "purple; it is one of the three primary colours of paint. Sailors, poets and "
        "painters have named many shades of it after the sea and the sky.")
    prompt_len, n = 20, len(history) - 1  # positions 0..n-1 committed, history[n] sampled
    assert n >= prompt_len + PENDING_LIMIT  # one batched forward on the way
    feats = LLM.from_engine(engine).hidden_states(history[:n], probe.hidden_layers)
    seq_id = 10**6
    probe.begin(seq_id, history[:prompt_len])
    try:
        probe.process([CommittedTokens(seq_id, 0, history[:prompt_len], history[prompt_len],
                                       {i: f[:prompt_len] for i, f in feats.items()})])
        forwards = probe.num_draft_forwards
        first = probe.draft([DraftRequest(seq_id, history[:prompt_len + 1], DraftParams(n_max=1))])
        assert probe.num_draft_forwards - forwards == 1  # the prompt's entries, in one forward
        assert first[seq_id].token_ids[0] == reference_first_draft(
            probe.head, {i: f[:prompt_len] for i, f in feats.items()}, history[:prompt_len + 1])
        forwards = probe.num_draft_forwards
        for pos in range(prompt_len, n):  # one decode step each, no draft asked...
            probe.process([CommittedTokens(seq_id, pos, [history[pos]], history[pos + 1],
                                           {i: f[pos:pos + 1] for i, f in feats.items()})])
            if pos + 1 == prompt_len + PENDING_LIMIT:  # ...but right after the batched forward
                assert probe.num_draft_forwards - forwards == 1
                seen = history[:pos + 2]
                first = probe.draft([DraftRequest(seq_id, seen, DraftParams(n_max=1))])
                assert probe.num_draft_forwards - forwards == 1  # nothing waits
                assert first[seq_id].token_ids[0] == reference_first_draft(
                    probe.head, {i: f[:pos + 1] for i, f in feats.items()}, seen)
        assert probe.num_draft_forwards - forwards == (n - prompt_len) // PENDING_LIMIT
        drafts = probe.draft([DraftRequest(seq_id, history, DraftParams(n_max=1))])
        assert probe.num_draft_forwards - forwards == (n - prompt_len) // PENDING_LIMIT + 1
        assert drafts[seq_id].token_ids[0] == reference_first_draft(probe.head, feats, history)
    finally:
        probe.end(seq_id)


@torch.inference_mode()
def test_no_further_forward_once_the_run_cannot_pay(eagle_engine):
    """A draft whose run product fell below p_min_run can take no further token: the head runs
    no forward for one (a random head's first token has probability ~1/draft_vocab)."""
    from speculant.speculators.base import DraftParams, DraftRequest

    engine = eagle_engine
    probe = engine.speculator(engine.speculator_names[0])
    history = engine.tokenizer.encode(chats(engine, ["Name a colour."])[0])
    feats = prompt_features(engine, history[:-1], probe.hidden_layers)
    drafts = {}
    for p_min_run in (0.0, 0.9):
        seq_id = 10**6 + 3
        probe.begin(seq_id, history[:-1])
        try:
            probe.process([committed_prompt(seq_id, history, feats)])
            forwards = probe.num_draft_forwards
            drafts[p_min_run] = probe.draft([DraftRequest(seq_id, history, DraftParams(
                n_max=4, p_min_run=p_min_run))])[seq_id].token_ids
            # the catch-up forward yields the first token; each further token one forward
            assert probe.num_draft_forwards - forwards == (4 if p_min_run == 0.0 else 1)
        finally:
            probe.end(seq_id)
    assert len(drafts[0.0]) == 4 and drafts[0.9] == drafts[0.0][:1]


def prompt_features(engine, token_ids, layers):
    from speculant.llm import LLM

    return LLM.from_engine(engine).hidden_states(token_ids, layers)


def committed_prompt(seq_id, history, feats):
    """The prompt history[:-1] committed, history[-1] sampled after it."""
    from speculant.speculators.base import CommittedTokens

    n = len(history) - 1
    return CommittedTokens(seq_id, 0, history[:n], history[n], {i: f[:n] for i, f in feats.items()})


@torch.inference_mode()
def test_a_silent_sequence_costs_no_forward_and_resumes_on_a_short_window(eagle_engine, monkeypatch):
    """A sequence the head was never asked about, or not for SILENT_AFTER tokens: its committed
    tokens only keep their features (no batched forward at PENDING_LIMIT); asked, the head
    restarts on the newest HEAD_WINDOW entries and drafts its answer for a sequence that
    starts there, in one forward."""
    from speculant.llm import LLM
    from speculant.speculators import feature_drafter
    from speculant.speculators.base import CommittedTokens, DraftParams, DraftRequest

    monkeypatch.setattr(feature_drafter, "PENDING_LIMIT", 8)
    monkeypatch.setattr(feature_drafter, "SILENT_AFTER", 8)
    monkeypatch.setattr(feature_drafter, "HEAD_WINDOW", 10)
    engine = eagle_engine
    probe = engine.speculator(engine.speculator_names[0])
    tok = engine.tokenizer
    history = tok.encode(chats(engine, ["Name a colour."])[0]) + tok.encode(
        " Blue is the colour of a clear sky at noon, of deep water far from the shore, and "
        "of many flags.")
    prompt_len, n = 12, len(history) - 1
    feats = LLM.from_engine(engine).hidden_states(history[:n], probe.hidden_layers)

    def commit(seq_id, pos):
        probe.process([CommittedTokens(seq_id, pos, [history[pos]], history[pos + 1],
                                       {i: f[pos:pos + 1] for i, f in feats.items()})])

    def first_draft(seq_id, seen, base):
        forwards = probe.num_draft_forwards
        drafts = probe.draft([DraftRequest(seq_id, history[:seen + 1], DraftParams(n_max=1))])
        assert probe.num_draft_forwards - forwards == 1
        assert probe._seqs[seq_id].base == base
        window = {i: f[base:seen] for i, f in feats.items()}
        assert drafts[seq_id].token_ids[0] == reference_first_draft(probe.head, window,
                                                                    history[base:seen + 1])

    seq_id = 10**6 + 9
    asked_at = prompt_len + 12
    assert n > asked_at + 8 + 10
    probe.begin(seq_id, history[:prompt_len])
    try:
        forwards = probe.num_draft_forwards
        probe.process([CommittedTokens(seq_id, 0, history[:prompt_len], history[prompt_len],
                                       {i: f[:prompt_len] for i, f in feats.items()})])
        for pos in range(prompt_len, asked_at):  # decode steps, the head never asked
            commit(seq_id, pos)
        assert probe.num_draft_forwards == forwards
        first_draft(seq_id, asked_at, asked_at - 10)  # the newest HEAD_WINDOW entries
        forwards = probe.num_draft_forwards
        for pos in range(asked_at, n):
            commit(seq_id, pos)
        # one batched forward while the sequence was recently asked, then none
        assert probe.num_draft_forwards - forwards == 1
        first_draft(seq_id, n, n - 10)  # after a silence too
    finally:
        probe.end(seq_id)


@torch.inference_mode()
def test_a_silent_sequence_reports_the_rows_its_revival_computes(eagle_engine, monkeypatch):
    """Never asked (or not lately), a sequence costs its waiting entries up to HEAD_WINDOW
    when asked, and the draft call books their share of the forward as catch-up; once asked
    and followed it costs none (its rows are computed anyway)."""
    from speculant.llm import LLM
    from speculant.speculators import feature_drafter
    from speculant.speculators.base import CommittedTokens, DraftParams, DraftRequest

    monkeypatch.setattr(feature_drafter, "HEAD_WINDOW", 10)
    engine = eagle_engine
    probe = engine.speculator(engine.speculator_names[0])
    tok = engine.tokenizer
    history = tok.encode(chats(engine, ["Name a colour."])[0]) + tok.encode(" Blue, like the sky.")
    n = len(history) - 1
    feats = LLM.from_engine(engine).hidden_states(history[:n], probe.hidden_layers)
    seq_id = 10**6 + 9
    probe.begin(seq_id, history[:n])
    try:
        probe.process([CommittedTokens(seq_id, 0, history[:n], history[n], feats)])
        assert n > 10 and probe.revival_rows(seq_id) == 10
        probe.draft([DraftRequest(seq_id, history, DraftParams(n_max=1))])
        assert probe.catch_up_rows == 9  # the window's rows before its newest
        assert 0 < probe.catch_up_seconds and probe.sunk_draft_seconds == 0.0
        probe.process([CommittedTokens(seq_id, n, [history[n]], 42,
                                       {i: f[-1:] for i, f in feats.items()})])
        assert probe.revival_rows(seq_id) == 0  # followed now
    finally:
        probe.end(seq_id)


def small_window_probe(engine, monkeypatch):
    """The engine's feature drafter with MAX_WAITING 24 and HEAD_WINDOW 10, a history longer
    than that, n = its committed length, and the target's features of those n tokens."""
    from speculant.llm import LLM
    from speculant.speculators import feature_drafter

    monkeypatch.setattr(feature_drafter, "MAX_WAITING", 24)
    monkeypatch.setattr(feature_drafter, "HEAD_WINDOW", 10)
    probe = engine.speculator(engine.speculator_names[0])
    tok = engine.tokenizer
    history = tok.encode(chats(engine, ["Name a colour."])[0]) + tok.encode(
        " Blue is the colour of a clear sky at noon, of deep water far from the shore.")
    n = len(history) - 1
    assert n > 24
    return probe, history, n, LLM.from_engine(engine).hidden_states(history[:n],
                                                                    probe.hidden_layers)


@torch.inference_mode()
def test_a_long_wait_restarts_the_head_on_a_window(eagle_engine, monkeypatch):
    """More than MAX_WAITING waiting entries (a long prompt chunk) restart the head's cache on the newest
    HEAD_WINDOW: the draft is then the head's answer for a sequence that starts at the
    window (RoPE positions from 0 there), computed in one forward of HEAD_WINDOW rows."""
    from speculant.speculators.base import CommittedTokens, DraftParams, DraftRequest

    probe, history, n, feats = small_window_probe(eagle_engine, monkeypatch)
    seq_id = 10**6 + 7
    probe.begin(seq_id, history[:n])
    try:
        probe.process([CommittedTokens(seq_id, 0, history[:n], history[n], feats)])
        base = n - 10
        assert probe._seqs[seq_id].base == base
        forwards = probe.num_draft_forwards
        drafts = probe.draft([DraftRequest(seq_id, history, DraftParams(n_max=1))])
        assert probe.num_draft_forwards - forwards == 1
        window = {i: f[base:] for i, f in feats.items()}
        assert drafts[seq_id].token_ids[0] == reference_first_draft(probe.head, window,
                                                                    history[base:])
        # decoding on from the window: positions keep mapping to head slots
        probe.process([CommittedTokens(seq_id, n, [history[n]], 42,
                                       {i: f[-1:] for i, f in feats.items()})])
        assert probe.draft([DraftRequest(seq_id, history + [42], DraftParams(n_max=2))])
    finally:
        probe.end(seq_id)


def test_a_long_chunk_needs_the_features_of_its_window_only(eagle_engine, monkeypatch):
    """Of a chunk longer than MAX_WAITING the drafter reads the newest HEAD_WINDOW rows
    (`feature_rows`): fed only those (`feature_skip`, as the engine captures them), it keeps
    the same window and drafts the same tokens as fed every row."""
    from speculant.speculators.base import CommittedTokens, DraftParams, DraftRequest

    probe, history, n, feats = small_window_probe(eagle_engine, monkeypatch)
    assert probe.feature_rows(-1, 24) == 24 and probe.feature_rows(-1, n) == 10
    full, windowed = 10**6 + 8, 10**6 + 9
    drafts = {}
    try:
        for seq_id, skip in ((full, 0), (windowed, n - 10)):
            probe.begin(seq_id, history[:n])
            probe.process([CommittedTokens(seq_id, 0, history[:n], history[n],
                                           {i: f[skip:] for i, f in feats.items()},
                                           feature_skip=skip)])
            assert probe._seqs[seq_id].base == n - 10
            assert len(probe._seqs[seq_id].tokens) == 10
            drafts[seq_id] = probe.draft([DraftRequest(seq_id, history, DraftParams(n_max=3))])
        assert drafts[windowed][windowed].token_ids == drafts[full][full].token_ids
    finally:
        probe.end(full)
        probe.end(windowed)


def test_a_prompt_in_chunks_needs_the_features_of_its_newest_window_only(eagle_engine,
                                                                         monkeypatch):
    """A prompt fed in chunks: the drafter reads the rows among the prompt's newest
    HEAD_WINDOW (`feature_rows` with the prompt tokens after the chunk), so the chunks
    before come without features (the step captured none) and the one that straddles the
    window with its newest rows only; it drafts what it drafts fed every row in one chunk.
    A chunk without features that leaves a gap is refused."""
    from speculant.speculators.base import CommittedTokens, DraftParams, DraftRequest

    probe, history, n, feats = small_window_probe(eagle_engine, monkeypatch)
    cuts = [0, 6, 12, n - 7, n]  # chunks of 6, 6, n - 19 and 7 tokens
    rows = [probe.feature_rows(-1, b - a, n - b) for a, b in zip(cuts, cuts[1:])]
    assert rows == [0, 0, 3, 7]
    full, chunked = 10**6 + 10, 10**6 + 11
    drafts = {}
    try:
        probe.begin(full, history[:n])
        probe.process([CommittedTokens(full, 0, history[:n], history[n], feats)])
        probe.begin(chunked, history[:n])
        for (a, b), num in zip(zip(cuts, cuts[1:]), rows):
            step = {i: f[b - num:b] for i, f in feats.items()} if num else None
            probe.process([CommittedTokens(chunked, a, history[a:b],
                                           history[n] if b == n else None, step,
                                           feature_skip=b - a - num if num else 0)])
        assert probe._seqs[chunked].base == n - 10
        for seq_id in (full, chunked):
            drafts[seq_id] = probe.draft([DraftRequest(seq_id, history, DraftParams(n_max=3))])
        assert drafts[chunked][chunked].token_ids == drafts[full][full].token_ids
        with pytest.raises(ValueError, match="skipped positions"):
            probe.process([CommittedTokens(chunked, n + 5, history[:2], None, None)])
    finally:
        probe.end(full)
        probe.end(chunked)


def spy_on_captures(engine, monkeypatch) -> list[tuple[tuple[int, ...], int]]:
    """Per target forward of `engine`, as it runs: (the layers it captured, the rows it
    captured of each)."""
    steps = []
    forward = engine.model.forward

    def spy(batch, cache):
        out = forward(batch, cache)
        rows = [h.shape[0] for h in out.hidden_states.values()]
        steps.append((tuple(batch.hidden_layers), rows[0] if rows else 0))
        return out

    monkeypatch.setattr(engine.model, "forward", spy)
    return steps


def test_a_sequence_the_head_is_never_asked_for_falls_dormant(eagle_engine, monkeypatch):
    """A sequence the chain never asks the head for is dormant after DORMANT_AFTER generated
    tokens: the target's steps capture no layer for it from then on, and the output still
    equals plain decoding."""
    from speculant.speculators import feature_drafter

    monkeypatch.setattr(feature_drafter, "DORMANT_AFTER", 4)
    prompts = chats(eagle_engine, PROMPTS[:1])
    plain = decode_all(eagle_engine, prompts, SamplingParams(max_tokens=16, temperature=0.0,
                                                             spec=SpecParams(enabled=False)))
    steps = spy_on_captures(eagle_engine, monkeypatch)
    monkeypatch.setattr(eagle_engine.chain, "_budget_model_drafts", lambda *a, **k: [])
    spec = decode_all(eagle_engine, prompts, SamplingParams(max_tokens=16, temperature=0.0,
                                                            spec=SpecParams(n_max=3)))
    assert spec[0].output_ids == plain[0].output_ids
    layers = eagle_engine.speculator(eagle_engine.speculator_names[0]).hidden_layers
    # the prompt and 5 generated tokens (one step each: nothing drafts) with the head's
    # layers, then none for the 11 steps left
    assert [captured for captured, _ in steps] == [tuple(sorted(layers))] * 6 + [()] * 10
    assert eagle_engine.stats.num_speculator_errors == 0


def test_a_prompt_in_chunks_captures_its_newest_window_only(eagle_engine, monkeypatch):
    """A prompt prefilled in 8-token chunks: the target captures the head's layers for the
    rows among the prompt's newest HEAD_WINDOW (6) only, none for the chunks before, and the
    speculative output still equals plain decoding."""
    from speculant.engine import scheduler
    from speculant.speculators import feature_drafter

    monkeypatch.setattr(feature_drafter, "HEAD_WINDOW", 6)
    monkeypatch.setattr(scheduler, "MIN_PREFILL_CHUNK", 8)
    monkeypatch.setattr(eagle_engine.scheduler, "max_num_batched_tokens", 8)
    prompts = chats(eagle_engine, PROMPTS[:1])
    plain = decode_all(eagle_engine, prompts, SamplingParams(max_tokens=12, temperature=0.0,
                                                             spec=SpecParams(enabled=False)))
    steps = spy_on_captures(eagle_engine, monkeypatch)
    spec = decode_all(eagle_engine, prompts, SamplingParams(max_tokens=12, temperature=0.0,
                                                            spec=SpecParams(n_max=3)))
    assert spec[0].output_ids == plain[0].output_ids
    num_prompt = len(eagle_engine.tokenizer.encode(prompts[0]))
    num_chunks = -(-num_prompt // 8)
    last = num_prompt - 8 * (num_chunks - 1)  # the last chunk's length
    rows = [num_rows for _, num_rows in steps]
    assert rows[:num_chunks - 2] == [0] * (num_chunks - 2)
    assert rows[num_chunks - 2:num_chunks] == [max(0, 6 - last), min(6, last)]
    assert eagle_engine.stats.num_speculator_errors == 0


def fed_probe(engine, seq_id: int, answer: str):
    """The engine's feature drafter, a chat prompt's ids, the history prompt + `answer` and
    `commit(start, end)`, which hands the drafter positions start..end-1 of the history with
    the target's features (`LLM.hidden_states`), as the engine's steps would."""
    from speculant.llm import LLM
    from speculant.speculators.base import CommittedTokens

    probe = engine.speculator(engine.speculator_names[0])
    tok = engine.tokenizer
    prompt = tok.encode(chats(engine, ["Name a colour."])[0])
    history = prompt + tok.encode(answer)
    feats = LLM.from_engine(engine).hidden_states(history, probe.hidden_layers)

    def commit(start, end):
        probe.process([CommittedTokens(seq_id, start, history[start:end], history[end],
                                       {i: f[start:end] for i, f in feats.items()})])

    return probe, prompt, history, commit


@torch.inference_mode()
def test_a_dormant_sequence_wakes_when_asked(eagle_engine, monkeypatch):
    """Asked for a dormant sequence, the head drafts nothing that round and starts its window
    at the step the target runs next; fed that step's features, it drafts again."""
    from speculant.speculators import feature_drafter
    from speculant.speculators.base import DraftParams, DraftRequest

    monkeypatch.setattr(feature_drafter, "DORMANT_AFTER", 4)
    probe, prompt, history, commit = fed_probe(eagle_engine, 10**6 + 11,
                                               " Blue is the colour of a clear sky at noon.")
    p, seq_id = len(prompt), 10**6 + 11
    monkeypatch.setattr(probe, "continuation", type(probe.continuation)())  # as fresh
    probe.begin(seq_id, prompt)
    try:
        commit(0, p)
        for i in range(p, p + 5):  # 5 generated tokens, never asked
            assert probe.feature_rows(seq_id, 1) == 1
            commit(i, i + 1)
        assert probe.feature_rows(seq_id, 1) == 0
        assert probe.revival_rows(seq_id) == feature_drafter.HEAD_WINDOW
        asked = p + 6  # history length when asked: positions 0..p+4 in the target's KV
        assert probe.draft([DraftRequest(seq_id, history[:asked], DraftParams(n_max=3))]) == {}
        assert probe.feature_rows(seq_id, 1) == 1 and probe.revival_rows(seq_id) == 0
        commit(asked - 1, asked)  # the step after the ask
        drafts = probe.draft([DraftRequest(seq_id, history[:asked + 1], DraftParams(n_max=3))])
        assert len(drafts[seq_id].token_ids) == 3
    finally:
        probe.end(seq_id)


@torch.inference_mode()
def test_a_sequence_not_asked_for_long_after_an_ask_falls_dormant(eagle_engine, monkeypatch):
    """Asked once, then not for DORMANT_SILENT committed tokens, a sequence sleeps as a
    never-asked one does (no features captured or kept; a revival priced as a full window),
    and asked again it wakes."""
    from speculant.speculators import feature_drafter
    from speculant.speculators.base import DraftParams, DraftRequest

    monkeypatch.setattr(feature_drafter, "DORMANT_SILENT", 3)
    probe, prompt, history, commit = fed_probe(eagle_engine, 10**6 + 13,
                                               " Blue is the colour of a clear sky at noon.")
    p, seq_id = len(prompt), 10**6 + 13
    # its draft is never verified: keep it out of what later tests' drafts learn
    monkeypatch.setattr(probe, "continuation", type(probe.continuation)())
    probe.begin(seq_id, prompt)
    try:
        commit(0, p)
        assert probe.draft([DraftRequest(seq_id, history[:p + 1], DraftParams(n_max=2))])
        for i in range(p, p + 5):  # asked at history p + 1; 5 tokens without an ask
            assert probe.feature_rows(seq_id, 1) == 1
            commit(i, i + 1)
        assert probe.feature_rows(seq_id, 1) == 0
        assert probe.revival_rows(seq_id) == feature_drafter.HEAD_WINDOW
        assert probe.draft([DraftRequest(seq_id, history[:p + 6], DraftParams(n_max=2))]) == {}
        assert probe.feature_rows(seq_id, 1) == 1  # awake again
    finally:
        probe.end(seq_id)


@torch.inference_mode()
def test_a_rested_sequence_keeps_no_features_and_drafts_again_once_woken(eagle_engine,
                                                                         monkeypatch):
    """The chain rests the head for a sequence it follows (drafter_ledger.py): no features are
    captured or kept for it (`feature_rows` 0); woken, its window starts at the step the
    target runs next, and fed that step's features it drafts."""
    from speculant.speculators.base import DraftParams, DraftRequest

    probe, prompt, history, commit = fed_probe(
        eagle_engine, 10**6 + 12, " Blue is the colour of a clear sky at noon, and of the sea.")
    p, seq_id = len(prompt), 10**6 + 12
    # draft lengths as a fresh drafter's, whatever earlier tests' drafts taught it
    monkeypatch.setattr(probe, "continuation", type(probe.continuation)())
    probe.begin(seq_id, prompt)
    try:
        commit(0, p)
        drafts = probe.draft([DraftRequest(seq_id, history[:p + 1], DraftParams(n_max=2))])
        assert len(drafts[seq_id].token_ids) == 2  # followed: it drafts
        commit(p, p + 1)
        probe.rest(seq_id)
        assert probe.feature_rows(seq_id, 1) == 0
        commit(p + 1, p + 2)  # a step while resting: nothing kept
        commit(p + 2, p + 3)
        probe.wake(seq_id, p + 4)  # history p + 4 tokens: positions 0..p + 2 in the KV
        assert probe.feature_rows(seq_id, 1) == 1
        commit(p + 3, p + 4)
        drafts = probe.draft([DraftRequest(seq_id, history[:p + 5], DraftParams(n_max=3))])
        assert len(drafts[seq_id].token_ids) == 3
    finally:
        probe.end(seq_id)


def test_greedy_output_equals_plain_through_rests_and_wakes(eagle_engine, monkeypatch):
    """The chain resting the head and waking it every few rounds (as the ledger does where it
    loses) changes no output, and the head drafts between its rests."""
    prompts = chats(eagle_engine, PROMPTS)
    plain = decode_all(eagle_engine, prompts, SamplingParams(max_tokens=40, temperature=0.0,
                                                             spec=SpecParams(enabled=False)), 4)
    probe = eagle_engine.speculator(eagle_engine.speculator_names[0])
    calls = {"rest": 0, "wake": 0}
    for call in calls:
        original = getattr(probe, call)

        def spy(*a, _call=call, _original=original):
            calls[_call] += 1
            return _original(*a)
        monkeypatch.setattr(probe, call, spy)
    rounds = iter(range(10**6))
    monkeypatch.setattr(eagle_engine.chain.ledger, "resting",
                        lambda name, bucket: next(rounds) % 6 >= 3)  # 3 rounds on, 3 off
    monkeypatch.setattr(eagle_engine.chain, "probe_interval", 0)  # every draft verified...
    monkeypatch.setattr(eagle_engine.chain, "rest_losers", True)  # ... but for the rests
    spec = decode_all(eagle_engine, prompts, SamplingParams(max_tokens=40, temperature=0.0,
                                                            spec=SpecParams(n_max=3)), 4)
    assert [s.output_ids for s in spec] == [s.output_ids for s in plain]
    assert calls["rest"] >= 4 and calls["wake"] >= 4
    assert sum(s.spec.num_draft_tokens for s in spec) > 0
    assert eagle_engine.stats.num_speculator_errors == 0


@torch.inference_mode()
def test_a_drafting_round_first_warms_the_heads_own_weights(eagle_engine, monkeypatch):
    """Each drafting round has the kernels' pool read the head's packed weights back into the
    caches first (the target's forward flushed them): the tensors its native layer reads, the
    LM head among them, never the target's token table or LM head (the target reads those
    itself)."""
    from speculant.speculators import feature_drafter
    from speculant.speculators.base import DraftParams, DraftRequest

    probe = eagle_engine.speculator(eagle_engine.speculator_names[0])
    if probe.packed_layer is None:
        pytest.skip("no packed layer for this head kind (or no native kernels)")
    warmed = set(t.data_ptr() for t in probe.warm_weights)
    assert probe.packed_layer.lm_head.data.data_ptr() in warmed
    assert probe.packed_layer.qkv.data.data_ptr() in warmed
    target = [getattr(m, f) for m in (probe.target.embed_table, probe.target.lm_head)
              for f in ("data", "scales", "mins") if isinstance(getattr(m, f, None), torch.Tensor)]
    assert target and not warmed & {t.data_ptr() for t in target}
    calls = []
    monkeypatch.setattr(feature_drafter, "warm_in_background", lambda ts: calls.append(ts))
    seq_id = 10**6 + 17
    probe, prompt, history, commit = fed_probe(eagle_engine, seq_id, " Green is a colour.")
    monkeypatch.setattr(probe, "continuation", type(probe.continuation)())  # as fresh
    probe.begin(seq_id, prompt)
    try:
        commit(0, len(prompt))
        drafts = probe.draft([DraftRequest(seq_id, history[:len(prompt) + 1],
                                           DraftParams(n_max=2))])
        assert len(drafts[seq_id].token_ids) == 2
    finally:
        probe.end(seq_id)
    assert len(calls) == 1 and calls[0] is probe.warm_weights


def packed_layer_probe(engine, num_rows: int, seed: int):
    """The engine's feature drafter (skips when its head has no packed layer), random hidden
    rows [num_rows, d] and as many random token ids."""
    probe = engine.speculator(engine.speculator_names[0])
    if probe.packed_layer is None:
        pytest.skip("no packed layer for this head kind (or no native kernels)")
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_rows, probe.head.config.hidden_size, generator=gen)
    ids = torch.randint(0, engine.model_config.vocab_size, (num_rows,), generator=gen).tolist()
    return probe, hidden, ids


@contextlib.contextmanager
def ragged_batch(cache, seq_id: int, ids: list[int], split: int, logits=(1, 1)):
    """Sequences seq_id and seq_id + 2 of the head's cache holding ids[:split] and ids[split:]
    from position 0, as one batch (`logits`: rows asking for logits per chunk); freed on exit."""
    from speculant.engine.forward_batch import SeqChunk, build_forward_batch

    cache.allocate(seq_id)
    cache.allocate(seq_id + 2)
    try:
        yield build_forward_batch(cache, [SeqChunk(seq_id, 0, ids[:split], logits[0]),
                                          SeqChunk(seq_id + 2, 0, ids[split:], logits[1])])
    finally:
        cache.free(seq_id)
        cache.free(seq_id + 2)


@torch.inference_mode()
def test_packed_layer_equals_the_reference_maths(eagle_engine):
    """The head's layer on the target's fused kernels (`PackedEagle3Layer`) gives the outputs and
    the K/V of the op-by-op reference path, on a ragged batch of two sequences."""
    from speculant.engine.forward_batch import SeqChunk, build_forward_batch

    probe, hidden, ids = packed_layer_probe(eagle_engine, 9, seed=0)  # 5 + 4 rows
    layer, cache = probe.packed_layer, probe.cache
    outs = {}
    for seq_id, packed in ((10**6, layer), (10**6 + 1, None)):  # same rows, own K/V each
        cache.allocate(seq_id)
        cache.allocate(seq_id + 2)
        chunks = [SeqChunk(seq_id, 0, ids[:5], 1), SeqChunk(seq_id + 2, 0, ids[5:], 1)]
        probe.packed_layer = packed
        try:
            batch = build_forward_batch(cache, chunks)
            outs[packed is not None] = (probe._run_layer(batch, hidden.clone())[0],
                                        gather_k(cache.k[0], batch.slot_mapping,
                                                 cache.block_size).float(),
                                        gather_v(cache.v[0], batch.slot_mapping).float())
        finally:
            probe.packed_layer = layer
            cache.free(seq_id)
            cache.free(seq_id + 2)
    for fast, ref in zip(outs[True], outs[False]):
        assert torch.allclose(fast, ref, atol=1e-4, rtol=1e-4), (fast - ref).abs().max()


def _chained_from_python(layer, embeds, hidden, batch, k_cache, v_cache):
    """The packed layer's maths as its kernels called one by one from Python (what the native
    `eagle3_layer` call chains in C++)."""
    from speculant.kernels import add_rms_norm, paged_attention, rms_norm, rope_write_kv, silu_mul

    eps, num_tokens = layer.eps, embeds.shape[0]
    h = hidden.float().contiguous().clone()
    x = torch.cat([rms_norm(embeds.float().contiguous(), layer.input_norm, eps),
                   rms_norm(h, layer.hidden_norm, eps)], dim=-1)
    q = rope_write_kv(layer.qkv(x), None, None, None, eps, layer.rope_cos, layer.rope_sin,
                      batch.positions, k_cache, v_cache, batch.slot_mapping, layer.num_heads)
    attn = paged_attention(q, k_cache, v_cache, batch.block_tables, batch.token_seq,
                           batch.positions.to(torch.int32), layer.scale)
    x = add_rms_norm(h, layer.o_proj(attn.reshape(num_tokens, -1)), layer.post_norm, eps)
    h.add_(layer.down(silu_mul(layer.gate_up(x))))
    rows = h.index_select(0, batch.logits_indices)
    return h, layer.lm_head(rms_norm(rows.contiguous(), layer.final_norm, eps))


@torch.inference_mode()
def test_one_native_call_equals_the_kernels_chained_from_python(eagle_engine):
    """The packed layer runs as one native call (csrc/head_layer.cpp) with the LM head over the
    rows that draft: its outputs, K/V and logits are bit-identical to the same kernels called
    one by one from Python, on a ragged batch of two sequences; without logits rows it returns
    the same outputs and no logits."""
    probe, hidden, ids = packed_layer_probe(eagle_engine, 7, seed=1)  # 4 + 3 rows
    layer, cache = probe.packed_layer, probe.cache
    embeds = probe.head.embed(torch.tensor(ids))
    outs = {}
    for seq_id, how in ((10**6, "one call"), (10**6 + 1, "chained"), (10**6 + 4, "no logits")):
        with ragged_batch(cache, seq_id, ids, 4, logits=(1, 2)) as batch:
            k, v = cache.k[0], cache.v[0]
            if how == "chained":
                h, logits = _chained_from_python(layer, embeds, hidden, batch, k, v)
            else:
                rows = batch.logits_indices if how == "one call" else None
                h, logits, _, _ = layer(embeds, hidden, batch, k, v, rows)
            outs[how] = (h, logits, gather_k(k, batch.slot_mapping, cache.block_size),
                         gather_v(v, batch.slot_mapping))
    assert outs["one call"][1].shape == (3, probe.head.config.draft_vocab_size)
    for got, ref in zip(outs["one call"], outs["chained"]):
        assert torch.equal(got, ref)
    assert outs["no logits"][1].shape[0] == 0
    assert torch.equal(outs["no logits"][0], outs["one call"][0])
    assert torch.equal(layer.logits(outs["one call"][0][[3, 5, 6]]), outs["one call"][1])


@torch.inference_mode()
def test_one_native_call_looks_up_fuses_and_picks_as_python_does(eagle_engine):
    """Given token ids (the target's token table in the call), the captured features (`fc` in
    the call) and `pick`, the native layer returns the bits of the unfused call fed the
    embeddings and fused hidden it would get from Python, and each logits row's
    `row_argmax(with_prob=True)`; the feature drafter hands it ids and raw features."""
    from speculant.kernels.argmax import row_argmax

    probe, _, ids = packed_layer_probe(eagle_engine, 7, seed=3)  # 4 + 3 rows
    layer, cache, head = probe.packed_layer, probe.cache, probe.head
    if layer.embed_table is None or layer.fc is None:
        pytest.skip("the head's layer takes neither ids nor features (float table or fc)")
    gen = torch.Generator().manual_seed(3)
    raw = torch.randn(7, head.fc.in_features, generator=gen)  # [T, n_feat * d]
    assert raw.shape[1] != layer.input_norm.shape[0]
    assert probe._layer_hidden(raw) is raw  # the drafter leaves the fusion to the call
    ids_t = torch.tensor(ids)
    outs = {}
    for seq_id, how in ((10**6, "fused"), (10**6 + 1, "python")):
        with ragged_batch(cache, seq_id, ids, 4, logits=(1, 2)) as batch:
            k, v = cache.k[0], cache.v[0]
            if how == "fused":
                h, logits, cols, probs = layer(ids_t, raw, batch, k, v, batch.logits_indices,
                                               pick=True)
            else:
                h, logits, cols, probs = layer(head.embed(ids_t), head.fuse(raw), batch, k, v,
                                               batch.logits_indices)
                assert cols.numel() == 0 and probs.numel() == 0  # no pick asked
                cols, probs = row_argmax(logits, with_prob=True)
            outs[how] = (h, logits, cols, probs, gather_k(k, batch.slot_mapping, cache.block_size),
                         gather_v(v, batch.slot_mapping))
    assert outs["fused"][2].shape == (3,) and outs["fused"][2].dtype == torch.int64
    for got, ref in zip(outs["fused"], outs["python"]):
        assert torch.equal(got, ref)


def test_the_native_layer_refuses_ids_it_cannot_embed(eagle_engine):
    """Token ids of another dtype, or features of the wrong width, are refused naming the
    problem, not read as something else."""
    probe, hidden, ids = packed_layer_probe(eagle_engine, 3, seed=4)
    layer, cache = probe.packed_layer, probe.cache
    with ragged_batch(cache, 10**6, ids, 2) as batch:
        with pytest.raises(RuntimeError, match="token ids must be int64"):
            layer(torch.tensor(ids, dtype=torch.int32), hidden, batch, cache.k[0], cache.v[0])
        with pytest.raises(RuntimeError, match="hidden must be"):
            layer(torch.tensor(ids), hidden[:, :-8], batch, cache.k[0], cache.v[0])


@torch.inference_mode()
def test_a_head_with_a_wider_mlp_than_the_target_runs_on_the_native_layer(tmp_path,
                                                                          target_config):
    """A head whose MLP is twice the target's width (`train-head --head-intermediate`) loads
    from the published layout, its packed layer gives the op-by-op reference maths' outputs on
    a ragged batch, and greedy output with it equals plain."""
    from speculant.engine.forward_batch import SeqChunk, build_forward_batch

    path = str(tmp_path / "wide")
    width = 2 * target_config.intermediate_size
    engine = engine_with_head(path, Eagle3Head.random(
        target_config, torch.arange(0, target_config.vocab_size, 7), seed=4,
        intermediate_size=width))
    probe = engine.speculator("eagle3")
    assert probe.head.config.intermediate_size == width
    from speculant.kernels import native_available

    assert (probe.packed_layer is not None) == native_available()
    if probe.packed_layer is not None:
        _, hidden, ids = packed_layer_probe(engine, 7, seed=2)
        layer, cache = probe.packed_layer, probe.cache
        outs = []
        for seq_id, packed in ((10**6, layer), (10**6 + 1, None)):
            cache.allocate(seq_id)
            cache.allocate(seq_id + 2)
            probe.packed_layer = packed
            try:
                batch = build_forward_batch(cache, [SeqChunk(seq_id, 0, ids[:4], 1),
                                                    SeqChunk(seq_id + 2, 0, ids[4:], 1)])
                outs.append(probe._run_layer(batch, hidden.clone())[0])
            finally:
                probe.packed_layer = layer
                cache.free(seq_id)
                cache.free(seq_id + 2)
        assert torch.allclose(outs[0], outs[1], atol=1e-4, rtol=1e-4), \
            (outs[0] - outs[1]).abs().max()
    engine.chain.probe_interval = 0
    prompt = chats(engine, ["Name a colour."])[0]
    assert_greedy_spec_equals_plain(engine, [prompt], max_tokens=12, n_max=2)


@pytest.mark.parametrize("field, value, message", [
    ("hidden_size", 1024, "hidden_size 1024"),
    ("vocab_size", 32000, "vocab_size 32000"),
])
def test_head_that_does_not_fit_is_refused(tmp_path, kind, random_head_dir, field, value, message):
    """A head made for another target is refused at load, naming the mismatch."""
    import json
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(random_head_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg[field] = value
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=message):
        Engine(model="default", spec_type=[kind], spec_options={kind: {"head": str(bad)}},
               num_threads=TEST_THREADS, kv_cache_tokens=1024)


def test_eagle3_layer_ids_that_do_not_fit_are_refused(tmp_path, target_config):
    """EAGLE-3 aux layers beyond the target's layer count are named at load."""
    import json

    path = tmp_path / "head"
    random_head("eagle3", target_config).save(str(path))
    cfg = json.loads((path / "config.json").read_text())
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 15, 40]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="aux layer ids"):
        Engine(model="default", spec_type=["eagle3"], spec_options={"eagle3": {"head": str(path)}},
               num_threads=TEST_THREADS, kv_cache_tokens=1024)


def test_missing_head_folder_is_a_clear_error(tmp_path, kind):
    """A head path that is not a head folder names the file it could not read."""
    with pytest.raises(FileNotFoundError, match="config.json"):
        Engine(model="default", spec_type=[kind],
               spec_options={kind: {"head": str(tmp_path / "nowhere")}},
               num_threads=TEST_THREADS, kv_cache_tokens=1024)


def _mtp_tensors(head: MtpHead) -> dict:
    from speculant.models.mtp_head import CANONICAL

    params = dict(head.named_parameters())
    return {key: params[name].detach().clone() for key, name in CANONICAL.items()}


def test_mtp_loads_deepseek_layout(tmp_path, target_config):
    """DeepSeek's `model.layers.{L}.*` MTP tensors load to the same module as `mtp.*`."""
    import json

    from safetensors.torch import save_file

    from speculant.models.mtp_head import DEEPSEEK

    head = random_head("mtp", target_config)
    to_deepseek = {v: k for k, v in DEEPSEEK.items()}
    prefix = f"model.layers.{target_config.num_layers}."
    tensors = {}
    for key, t in _mtp_tensors(head).items():
        rest = to_deepseek.get(key) or key[len("mtp.layers.0."):]
        tensors[prefix + rest] = t.contiguous()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": target_config.hidden_size}))
    loaded = MtpHead.load(str(tmp_path), target_config)
    for (name, a), (_, b) in zip(head.named_parameters(), loaded.named_parameters()):
        assert torch.equal(a, b), name


def test_mtp_loads_gguf_nextn_tensors(tmp_path, target_config):
    """llama.cpp's `blk.{L}.nextn.*` + block tensors (q/k rows in GGUF order) load exactly."""
    import gguf
    import numpy as np

    from speculant.models.loader import HF_LAYER_NAMES
    from speculant.models.mtp_head import GGUF_NEXTN

    head = random_head("mtp", target_config)
    to_gguf = {v: k for k, v in GGUF_NEXTN.items()}
    to_gguf.update({f"mtp.layers.0.{hf}": g for hf, g in HF_LAYER_NAMES.items()})
    path = str(tmp_path / "mtp.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    for key, t in _mtp_tensors(head).items():
        data = t.numpy().astype(np.float32)
        name = to_gguf[key]
        heads = {"attn_q.weight": target_config.num_heads, "attn_k.weight": target_config.num_kv_heads}
        if name in heads:  # store in llama.cpp's interleaved-RoPE row order
            rows, half = data.shape[0], data.shape[0] // heads[name] // 2
            order = np.arange(rows).reshape(heads[name], half, 2).transpose(0, 2, 1).reshape(-1)
            data = data[np.argsort(order)]
        writer.add_tensor(f"blk.{target_config.num_layers}.{name}", np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    loaded = MtpHead.load(path, target_config)
    for (name, a), (_, b) in zip(head.named_parameters(), loaded.named_parameters()):
        assert torch.equal(a, b), name


@torch.inference_mode()
def test_a_two_layer_head_drafts_through_both_layers(tmp_path, target_config):
    """A head of two decoder layers (`train-head --head-layers 2`) keeps a KV cache per layer:
    its first draft after the prompt is the head's own full-sequence maths through both
    layers, the packed path (first layer native, the second op by op) gives the reference
    path's outputs on a ragged batch, and greedy output with multi-token drafts equals plain."""
    from speculant.llm import LLM

    path = str(tmp_path / "deep")
    engine = engine_with_head(path, Eagle3Head.random(
        target_config, torch.arange(0, target_config.vocab_size, 7), seed=5, num_layers=2))
    probe = engine.speculator("eagle3")
    assert probe.head.num_layers == 2 and len(probe.cache.k) == 2
    if probe.packed_layer is not None:
        _, hidden, ids = packed_layer_probe(engine, 7, seed=2)
        layer, cache = probe.packed_layer, probe.cache
        outs = []
        for seq_id, packed in ((10**6, layer), (10**6 + 1, None)):
            probe.packed_layer = packed
            try:
                with ragged_batch(cache, seq_id, ids, 4) as batch:
                    outs.append((probe._run_layer(batch, hidden.clone())[0],
                                 gather_k(cache.k[1], batch.slot_mapping,
                                          cache.block_size).float()))
            finally:
                probe.packed_layer = layer
        for fast, ref in zip(*outs):
            assert torch.allclose(fast, ref, atol=1e-4, rtol=1e-4), (fast - ref).abs().max()
    engine.chain.probe_interval = 0
    prompts = chats(engine, ["Name a colour.", "Count from one to five."])
    with first_drafts(probe) as drafted:
        assert_greedy_spec_equals_plain(engine, prompts, max_tokens=16, n_max=3)
    assert drafted, "the head never drafted"
    history, first = drafted[0]
    features = LLM.from_engine(engine).hidden_states(history[:-1], probe.hidden_layers)
    assert first == reference_first_draft(probe.head, features, history)
    assert probe.head.num_layers == 2 and engine.chain.stats["eagle3"].num_draft_tokens > 0
