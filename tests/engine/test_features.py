"""Target-feature capture: the residual stream of committed tokens only, as a fresh prefill sees it."""
import pytest
import torch

from conftest import TEST_THREADS
from speculant.engine.engine import Engine
from speculant.engine.sampling_params import SamplingParams, SpecParams
from speculant.kernels.native import forced_prompt_attention
from speculant.speculators.base import Draft, Speculator
from speculant.speculators.registry import register, unregister

COPY_PROMPT = ("Repeat this list exactly: alpha, beta, gamma, delta, epsilon, zeta, eta, theta, "
               "iota, kappa, lambda, mu, nu, xi, omicron, pi, rho, sigma, tau, upsilon.")
LAYERS = (1, 14, 29)


class FeatureProbe(Speculator):
    """Drafts a wrong token half the time (so rows get rejected) and records what it is fed."""

    name = "feature_probe"
    hidden_layers = (14,)

    def __init__(self, ctx, config=None):
        self.fed: dict[int, list[tuple[int, torch.Tensor]]] = {}
        self.round = 0

    def begin(self, seq_id, prompt_ids):
        self.fed[seq_id] = []

    def process(self, batch):
        for c in batch:
            assert c.hidden_states is not None and 14 in c.hidden_states
            assert c.hidden_states[14].shape[0] == c.num_feature_rows
            self.fed[c.seq_id].append((c.start_pos + c.feature_skip, c.hidden_states[14].clone()))

    def draft(self, requests):
        self.round += 1
        tok = 0 if self.round % 2 else requests[0].token_ids[-1]
        return {r.seq_id: Draft([tok, tok], expected_accepted=2.0) for r in requests}

    def accept(self, seq_id, num_accepted, is_other):
        pass

    def end(self, seq_id):
        pass



def prefill_features(engine, token_ids):
    seq = engine.add_request(token_ids, SamplingParams(max_tokens=1, temperature=0.0,
                                                       spec=SpecParams(enabled=False)),
                             hidden_layers=LAYERS)
    while engine.has_unfinished():
        engine.step()
    engine.release(seq)
    return engine.captured_hidden_states(seq)


def test_speculative_decode_features_equal_a_fresh_prefill(default_engine):
    """Features kept while decoding with drafts (rejected rows dropped) are bit-identical to
    those of one prefill over prompt + output: one row per processed token, none extra. (With
    fp32 prompt attention: on AMX-BF16 tiles the fresh prefill's output positions would be
    prompt positions, attended in another float order.)"""
    with forced_prompt_attention("fp32"):
        check_decode_features_equal_a_fresh_prefill(default_engine)


def check_decode_features_equal_a_fresh_prefill(engine):
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": COPY_PROMPT}])
    seq = engine.add_request(prompt, SamplingParams(max_tokens=48, temperature=0.0),
                             hidden_layers=LAYERS)
    while engine.has_unfinished():
        engine.step()
    engine.release(seq)
    assert seq.spec.num_drafts > 0 and seq.spec.num_draft_tokens > seq.spec.num_accepted_tokens
    decoded = engine.captured_hidden_states(seq)
    fresh = prefill_features(engine, seq.token_ids[:-1])
    for layer in LAYERS:
        assert decoded[layer].shape == (len(seq.token_ids) - 1, engine.model_config.hidden_size)
        assert torch.equal(decoded[layer], fresh[layer]), f"layer {layer} differs"


@pytest.fixture()
def probe_engine():
    register(FeatureProbe)
    try:
        yield Engine(model="default", spec_type=["feature_probe"], num_threads=TEST_THREADS,
                     kv_cache_tokens=4096, max_num_seqs=2)
    finally:
        unregister(FeatureProbe.name)


def test_speculators_receive_features_of_committed_tokens_only(probe_engine):
    """A speculator asking for a layer gets exactly one row per committed token, in order,
    equal to the request's own captured features; rejected draft rows never reach it."""
    # (the probe drafts a wrong token every other round, so rows are rejected along the way)
    engine = probe_engine
    probe = engine.speculator("feature_probe")
    seqs = [engine.add_request(p, SamplingParams(max_tokens=24, temperature=0.0), hidden_layers=(14,))
            for p in ("Count from one to ten.", "Name three colours.")]
    while engine.has_unfinished():
        engine.step()
    for seq in seqs:
        assert seq.spec.num_draft_tokens > seq.spec.num_accepted_tokens  # rows were rejected
        fed = probe.fed[seq.seq_id]
        starts = [start for start, _ in fed]
        rows = torch.cat([h for _, h in fed])
        assert starts == sorted(starts) and starts[0] == 0
        captured = engine.captured_hidden_states(seq)[14]
        assert captured.shape[0] == len(seq.token_ids) - 1
        # the step that finished the sequence is not mirrored (the speculator has ended it)
        assert seq.num_prompt < rows.shape[0] < captured.shape[0]
        assert torch.equal(rows, captured[:rows.shape[0]])


class WindowProbe(FeatureProbe):
    """A feature reader that never reads more than the newest 4 rows of a chunk."""

    name = "window_probe"

    def feature_rows(self, seq_id, num_tokens, tokens_after=0):
        return min(num_tokens, 4)


def test_a_speculator_reading_a_chunks_newest_rows_gets_only_those(monkeypatch):
    """The target captures, of a prompt chunk, only the rows its readers want: a speculator
    reading the newest 4 gets those 4 (equal to a full prefill's), in the same step as a
    request that asked for all its rows and gets them all."""
    register(WindowProbe)
    try:
        engine = Engine(model="default", spec_type=["window_probe"], num_threads=TEST_THREADS,
                        kv_cache_tokens=4096, max_num_seqs=2)
        captured_rows = []  # (rows in the batch, rows captured) per forward
        forward = engine.model.forward

        def recording(batch, cache):
            out = forward(batch, cache)
            captured_rows.append((batch.num_tokens, out.hidden_states[14].shape[0]))
            return out

        monkeypatch.setattr(engine.model, "forward", recording)
        tok = engine.tokenizer
        prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]))
                   for p in (COPY_PROMPT, "Name three colours.")]
        params = SamplingParams(max_tokens=6, temperature=0.0)
        probed = engine.add_request(prompts[0], params)
        public = engine.add_request(prompts[1], params, hidden_layers=(14,))
        while engine.has_unfinished():
            engine.step()
        num_tokens, num_rows = captured_rows[0]  # the first step, prefilling both
        assert num_rows < num_tokens
        fed = engine.speculator("window_probe").fed
        fresh = prefill_features(engine, prompts[0])[14]
        chunks = [(start, rows) for start, rows in fed[probed.seq_id] if start < len(prompts[0])]
        assert chunks and all(rows.shape[0] <= 4 for _, rows in chunks)
        for start, rows in chunks:
            assert torch.equal(rows, fresh[start:start + rows.shape[0]])
        assert chunks[-1][0] + chunks[-1][1].shape[0] == len(prompts[0])  # the prompt's newest
        fresh = prefill_features(engine, prompts[1])[14]
        rows = torch.cat([rows for start, rows in fed[public.seq_id] if start < len(prompts[1])])
        assert torch.equal(rows, fresh)  # a request that asked for every row: all, for both
        assert torch.equal(engine.captured_hidden_states(public)[14][:len(prompts[1])], fresh)
    finally:
        unregister(WindowProbe.name)


def test_no_capture_without_a_request_for_it(default_engine, monkeypatch):
    """Model-free speculators ask for no layer: the target forward is asked for none."""
    engine = default_engine
    seen = []
    forward = engine.model.forward
    monkeypatch.setattr(engine.model, "forward",
                        lambda batch, cache: seen.append(batch.hidden_layers) or forward(batch, cache))
    engine.run_to_completion(["Say hello."], SamplingParams(max_tokens=8, temperature=0.0))
    assert seen and all(layers == () for layers in seen)


def test_bad_layer_is_refused(default_engine):
    """A layer outside the model is an error naming it."""
    with pytest.raises(ValueError, match="hidden layer 30"):
        default_engine.add_request("hi", SamplingParams(max_tokens=1), hidden_layers=(30,))


class OracleDrafter(Speculator):
    """Drafts the next tokens of a known output (`continuation`), so every draft is accepted."""

    name = "oracle_drafter"
    continuation: list[int] = []

    def __init__(self, ctx, config=None):
        self.prompt_len: dict[int, int] = {}

    def begin(self, seq_id, prompt_ids):
        self.prompt_len[seq_id] = len(prompt_ids)

    def process(self, batch):
        pass

    def draft(self, requests):
        out = {}
        for r in requests:
            done = len(r.token_ids) - self.prompt_len[r.seq_id]
            ids = self.continuation[done:done + r.params.n_max]
            if ids:
                out[r.seq_id] = Draft(ids, expected_accepted=float(len(ids)))
        return out

    def accept(self, seq_id, num_accepted, is_other):
        pass

    def end(self, seq_id):
        pass


def test_a_stop_inside_an_accepted_draft_drops_the_rows_after_it():
    """A stop token accepted in the middle of a draft ends the output there: the features of
    the draft tokens the target read after it are not kept (one row per token but the last)."""
    register(OracleDrafter)
    try:
        engine = Engine(model="default", spec_type=["oracle_drafter"], num_threads=TEST_THREADS,
                        kv_cache_tokens=4096, max_num_seqs=1, spec_n_max=6)
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": COPY_PROMPT}])
        ref = engine.run_to_completion([prompt], SamplingParams(
            max_tokens=24, temperature=0.0, spec=SpecParams(enabled=False)))[0]
        plain = ref.token_ids[ref.num_prompt:]
        OracleDrafter.continuation = list(plain)
        stop = plain[9]  # inside the second draft (tokens 7-12)
        assert stop not in plain[:9]
        seq = engine.add_request(prompt, SamplingParams(max_tokens=24, temperature=0.0,
                                                        stop_token_ids=[stop]), hidden_layers=LAYERS)
        while engine.has_unfinished():
            engine.step()
        engine.release(seq)
        assert seq.token_ids[seq.num_prompt:] == plain[:10]
        assert seq.spec.num_accepted_tokens > 9  # the tokens after the stop were accepted too
        for rows in engine.captured_hidden_states(seq).values():
            assert rows.shape[0] == len(seq.token_ids) - 1
    finally:
        unregister(OracleDrafter.name)
