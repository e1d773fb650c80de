"""`speculant bench`: report building, interference detection, replay, peers and the CLI."""
import json
import random
import statistics
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from speculant.bench import timing as bench_timing
from speculant.bench.options import (merge_spec_options, parse_compare, parse_method_specs,
                                     wants_another_repeat)
from speculant.bench.report import (
    PeerResult,
    RunResult,
    build_report,
    markdown_table,
    peers_table,
    summary_text,
    write_outputs,
)
from speculant.bench.timing import CpuSample, cpu_usage, read_proc_stat, run_with_reruns
from speculant.cli.main import main

TOP_KEYS = {"schema", "date", "elapsed_s", "machine", "model", "dtype", "kv_dtype", "max_tokens",
            "concurrency", "sampling",
            "repeats", "min_seconds", "max_repeats", "interleave_s", "peer_repeats", "methods", "method_options", "results",
            "categories", "by_method", "peers", "summary", "interference", "files"}
RESULT_KEYS = {"method", "category", "concurrency", "num_prompts", "prompt_tokens",
               "generated_tokens", "prefill_tok_s", "decode_tok_s", "decode_tok_s_best",
               "repeats_decode_tok_s", "e2e_tok_s", "speedup", "mean_accepted_length",
               "mean_accepted_length_per_draft", "acceptance_rate", "draft_time_share", "identical_to_plain", "num_steps",
               "num_drafts", "num_draft_tokens", "num_accepted_tokens", "interference",
               "other_cpu_cores", "own_cpu_util", "num_reruns", "row_cost", "tuner",
               "rests", "repeats_speedup", "vs_untuned", "decode_coverage",
               "request_decode_tok_s", "repeats_request_decode_tok_s", "request_speedup",
               "request_vs_untuned", "speedup_ci", "vs_untuned_ci", "mean_accepted_length_ci",
               "prompt_decode", "prompt_decode_repeats"}
META = {"date": "2025-05-01T10:20:30+00:00", "elapsed_s": 12.5, "model": "/m/model.gguf",
        "dtype": "auto", "kv_dtype": "float16",
        "max_tokens": 64, "concurrency": [1, 8], "repeats": 1, "min_seconds": 8.0, "max_repeats": 5,
        "interleave_s": 0.1, "peer_repeats": 1,
        "sampling": {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "verify": "auto"},
        "methods": ["plain", "suffix"], "method_options": {},
        "machine": {"cpu": "test cpu", "num_cpus": 2, "threads": 2, "platform": "x",
                    "python": "3", "torch": "2"}}


def result(method, category, concurrency, rate, same=None, accepted=0):
    return RunResult(method=method, concurrency=concurrency, category=category, num_prompts=2,
                     prompt_tokens=100, generated_tokens=128, prefill_tok_s=500.0,
                     decode_tok_s=rate, e2e_tok_s=rate / 2, mean_accepted_length=1 + accepted / 10,
                     acceptance_rate=0.5 if accepted else 0.0, draft_time_share=0.01,
                     identical_to_plain=same, repeats_decode_tok_s=[rate], decode_tok_s_best=rate,
                     num_steps=10, num_drafts=5 if accepted else 0,
                     num_draft_tokens=2 * accepted, num_accepted_tokens=accepted)


def synthetic_report():
    results = [result("plain", "summarization", 1, 50.0), result("suffix", "summarization", 1, 100.0, 2, 8),
               result("plain", "summarization", 8, 200.0), result("suffix", "summarization", 8, 300.0, 2, 8),
               result("plain", "qa", 1, 60.0), result("suffix", "qa", 1, 54.0, 1, 1),
               result("plain", "qa", 8, 240.0), result("suffix", "qa", 8, 240.0, 2, 1)]
    peers = [PeerResult("hf_transformers_fp32", "hf", "plain", cat, 2, 128, [254], [25.4],
                        interference=False, detail={"dtype": "float32"}) for cat in ("summarization", "qa")]
    return build_report(dict(META), results, peers)


def test_report_speedups_and_best():
    """Speedup is relative to plain at the same category and concurrency; best is the fastest."""
    report = synthetic_report()
    by = {(r["category"], r["method"], r["concurrency"]): r for r in report["results"]}
    assert by[("summarization", "suffix", 1)]["speedup"] == 2.0
    assert by[("qa", "suffix", 1)]["speedup"] == 0.9
    assert report["summary"]["summarization"]["1"]["method"] == "suffix"
    assert report["summary"]["qa"]["8"]["speedup"] == 1.0
    assert report["by_method"]["suffix"]["1"]["identical_to_plain"] == 3


def test_speedup_pairs_the_repeats_that_ran_side_by_side():
    """Repeat k of a method is compared with repeat k of plain (the machine's drift cancels in
    each ratio): a method 2% behind plain in every repeat reads 0.98x even when the medians of
    the rates, taken from different repeats, would say 0.90x; the tuned twin is also compared
    with its untuned method, pair by pair."""
    def rated(method, rates):
        r = result(method, "qa", 1, sorted(rates)[1])
        r.repeats_decode_tok_s = rates
        return r

    plain = [100.0, 150.0, 200.0]
    untuned = [98.0, 90.0, 196.0]  # 0.98, 0.60, 0.98 of plain
    tuned = [99.0, 147.0, 198.0]  # 0.99, 0.98, 0.99
    report = build_report(dict(META), [rated("plain", plain), rated("suffix", untuned),
                                       rated("suffix+tuned", tuned)], [])
    by = {r["method"]: r for r in report["results"]}
    assert by["suffix+tuned"]["repeats_speedup"] == [0.99, 0.98, 0.99]
    assert by["suffix+tuned"]["speedup"] == 0.99
    assert by["suffix"]["speedup"] == 0.98
    assert by["suffix+tuned"]["vs_untuned"] == pytest.approx(1.0102, abs=1e-3)
    assert by["suffix"]["vs_untuned"] is None and by["plain"]["vs_untuned"] is None
    assert "vs untuned" in markdown_table(report).splitlines()[0]
    # repeats that do not pair up fall back to the ratio of the medians
    report = build_report(dict(META), [rated("plain", plain), rated("suffix", untuned[:2])], [])
    assert report["results"][1]["speedup"] == round(statistics.median(untuned[:2]) / 150.0, 3)
    assert report["results"][1]["repeats_speedup"] == []


def test_request_decode_rate_averages_each_requests_own_speed():
    """A request's own decode speed is its tokens after the first over the time of the steps
    that decoded it; requests with no decoding step or a single token are left out; coverage
    is the share of generated tokens the decode-only steps committed."""
    from types import SimpleNamespace as NS

    from speculant.bench.benchmark import Run, request_decode_rate

    seqs = [NS(num_generated=11, decode_step_time_s=2.0),  # 5 tok/s
            NS(num_generated=5, decode_step_time_s=1.0),  # 4 tok/s
            NS(num_generated=9, decode_step_time_s=0.0),
            NS(num_generated=1, decode_step_time_s=0.0)]
    assert request_decode_rate(seqs) == pytest.approx(4.5)
    assert request_decode_rate(seqs[2:]) == 0.0
    run = Run(1.0, NS(decode_tokens=13, decode_time_s=2.0), seqs, None, 0)
    assert run.decode_coverage == pytest.approx(13 / 26)
    assert run.request_decode_rate == pytest.approx(4.5) and run.decode_rate == 6.5


def test_request_speedups_pair_the_repeats():
    """request_speedup pairs each repeat's per-request rate with plain's (vs the untuned twin
    for METHOD+tuned), independently of the decode-only rate; a cell whose decode-only steps
    held few of its tokens names the per-request speedup in its progress line."""
    from types import SimpleNamespace as NS

    from speculant.bench.benchmark import _progress_line

    def rated(method, rates, per_request, coverage=1.0):
        r = result(method, "code_edit", 8, rates[0])
        r.repeats_decode_tok_s, r.decode_coverage = rates, coverage
        r.repeats_request_decode_tok_s = per_request
        return r

    results = [rated("plain", [100.0, 120.0], [10.0, 12.0]),
               rated("draft", [150.0, 120.0], [15.0, 13.2], 0.2),
               rated("draft+tuned", [110.0, 132.0], [16.5, 13.2], 0.15)]
    report = build_report(dict(META), results, [])
    by = {r["method"]: r for r in report["results"]}
    assert by["plain"]["request_speedup"] == 1.0
    assert by["draft"]["request_speedup"] == pytest.approx(1.3)  # median of 1.5 and 1.1
    assert by["draft+tuned"]["request_vs_untuned"] == pytest.approx(1.05)  # 1.1 and 1.0
    assert by["draft"]["request_vs_untuned"] is None
    plain_runs = [NS(decode_rate=100.0, request_decode_rate=10.0),
                  NS(decode_rate=120.0, request_decode_rate=12.0)]
    line = _progress_line(results[1], plain_runs)
    assert "decode-only steps 20% of the tokens, per request 1.30x" in line
    assert "per request" not in _progress_line(results[0], plain_runs)


def test_report_json_schema_keys():
    """The document has the documented keys at every level, and it is valid JSON."""
    report = json.loads(json.dumps(synthetic_report()))
    assert set(report) == TOP_KEYS
    assert all(set(r) == RESULT_KEYS for r in report["results"])
    cat = report["categories"]["summarization"]
    assert set(cat) == {"num_prompts", "methods", "peers"}
    assert set(cat["methods"]["suffix"]["8"]) == RESULT_KEYS - {"method", "category", "concurrency"}
    assert cat["peers"]["hf_transformers_fp32"] == {"decode_tok_s": 10.0, "ratio_plain": 5.0,
                                                    "ratio_best": 10.0, "best_method": "suffix"}
    peer = report["peers"]["hf_transformers_fp32"]
    assert peer["decode_tok_s"] == 10.0 and peer["num_prompts"] == 4 and peer["kind"] == "hf"
    assert set(peer["per_category"]) == {"summarization", "qa"}


def test_report_text():
    """The table has one row per result; the summary names each category's best method."""
    report = synthetic_report()
    table = markdown_table(report)
    assert len(table.splitlines()) == 2 + len(report["results"])
    assert "| summarization | suffix" in table and "2.00x" in table
    assert "hf_transformers_fp32" in peers_table(report)
    text = summary_text(report)
    assert "summarization" in text and "suffix" in text and "NOT faster" in text


def test_chart_and_json_written(tmp_path):
    """The chart is a valid PNG and the JSON file names it; both are named by the run's date."""
    report = synthetic_report()
    files = write_outputs(report, str(tmp_path / "out"))
    assert files["chart"].endswith("bench-20250501-102030.png")
    with open(files["chart"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with open(files["json"]) as f:
        assert json.load(f)["files"] == files


# ---- interference ------------------------------------------------------------------------------

def cpu(wall, own, busy=None, steal=0.0, load=None):
    return CpuSample(wall, own, busy, None if busy is None else steal, load)


@pytest.mark.parametrize("before, after, threads, flagged", [
    # quiet machine: all busy time is ours
    (cpu(0, 0, busy=100, load=2.0), cpu(10, 19.5, busy=119.5, load=2.0), 2, False),
    # another process took a whole core for the whole measurement
    (cpu(0, 0, busy=100), cpu(10, 10, busy=120), 2, True),
    # hypervisor steal counts as others' time
    (cpu(0, 0, busy=100, steal=0), cpu(10, 10, busy=115, steal=5), 1, True),
    # a few ticks of others' time is noise
    (cpu(0, 0, busy=100), cpu(10, 10, busy=110.03), 1, False),
    # no /proc/stat: load above our threads counts as others
    (cpu(0, 0, load=3.5), cpu(10, 19, load=3.6), 2, True),
    (cpu(0, 0, load=1.0), cpu(10, 19, load=2.1), 2, False),
])
def test_interference_verdict(before, after, threads, flagged):
    """Interference = others' average cores above the tolerance."""
    usage = cpu_usage(before, after, threads)
    assert usage.interference is flagged
    assert bool(usage.reason) is flagged


def test_interference_numbers():
    """Own utilisation and others' cores come out of the counters as defined."""
    usage = cpu_usage(cpu(0, 0, busy=100), cpu(10, 15, busy=125), threads=2)
    assert usage.own_cpu_util == pytest.approx(0.75)
    assert usage.other_cpu_cores == pytest.approx(1.0)


def test_read_proc_stat(tmp_path):
    """Busy = every state but idle and iowait; steal separately; seconds at the clock tick."""
    path = tmp_path / "stat"
    path.write_text("cpu  100 0 50 1000 20 0 10 40 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n")
    hz = bench_timing.os.sysconf("SC_CLK_TCK")
    assert read_proc_stat(str(path)) == pytest.approx((200 / hz, 40 / hz))
    assert read_proc_stat(str(tmp_path / "missing")) is None


def test_rerun_until_clean(monkeypatch):
    """An interfered run is re-run; the first clean one is kept and warned about once."""
    samples = iter([cpu(0, 0, busy=0), cpu(1, 1, busy=2),  # others used a core: rerun
                    cpu(1, 1, busy=2), cpu(2, 2, busy=3)])  # clean
    monkeypatch.setattr(bench_timing, "sample", lambda: next(samples))
    warnings = []
    calls = []
    value, usage, reruns = run_with_reruns(lambda: calls.append(1) or len(calls), 1, 3, "t",
                                           warn=warnings.append)
    assert (value, reruns, usage.interference, len(warnings)) == (2, 1, False, 1)


# ---- arguments ---------------------------------------------------------------------------------

@pytest.mark.parametrize("value, kinds", [
    ("hf", ["hf"]),
    ("hf,openai=http://127.0.0.1:8080", ["hf", "openai"]),
    ("openai=https://example.org/v1", ["openai"]),
])
def test_parse_compare(value, kinds):
    assert [p.kind for p in parse_compare(value)] == kinds


@pytest.mark.parametrize("value", ["vllm", "openai", "openai=localhost:8080", "hf=1", ","])
def test_bad_compare_errors_clearly(value, capsys):
    """A bad --compare exits 2 naming the flag, before any model is loaded."""
    assert main(["bench", "--compare", value]) == 2
    assert "--compare" in capsys.readouterr().err


# ---- replay ------------------------------------------------------------------------------------

def write_records(path):
    rng = random.Random(0)
    with open(path, "w") as f:
        for i, cat in enumerate(["summarization", "summarization", "qa"]):
            prompt = [rng.randrange(1000) for _ in range(200)]
            # summaries copy spans of their prompt; answers are unpredictable
            out = prompt[20:90] + prompt[120:160] if cat == "summarization" else \
                [rng.randrange(1000) for _ in range(40)]
            f.write(json.dumps({"id": f"r{i}", "category": cat, "prompt_ids": prompt,
                                "output_ids": out}) + "\n")


def last_json(capsys):
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_replay_per_category(tmp_path, capsys):
    """Replay measures each chain per category without a model: copies are drafted, noise not."""
    records = tmp_path / "records.jsonl"
    write_records(records)
    argv = ["bench", "--replay", str(records), "--spec-type", "suffix;ngram_simple,suffix",
            "--out-dir", str(tmp_path / "out")]
    assert main(argv) == 0
    report = last_json(capsys)
    rows = {(r["category"], r["method"]): r for r in report["results"]}
    assert set(rows) == {(c, m) for c in ("summarization", "qa") for m in ("suffix", "ngram_simple,suffix")}
    assert rows[("summarization", "suffix")]["mean_accepted_length"] > 2
    assert rows[("qa", "suffix")]["num_accepted_tokens"] == 0
    assert rows[("summarization", "suffix")]["num_records"] == 2
    assert report["files"]["json"].startswith(str(tmp_path / "out"))
    # est_speedup follows its definition from the row's own counts and the default row cost
    row, cost = rows[("summarization", "suffix")], report["row_cost"]
    decoded = row["num_generated"] - row["num_records"]
    assert row["est_speedup"] == pytest.approx(
        decoded / (row["num_steps"] + cost * row["num_draft_tokens"]), abs=1e-3)
    assert rows[("qa", "suffix")]["est_speedup"] <= 1.0  # drafts nothing it gets accepted


def test_methods_carry_options_of_their_own():
    """`CHAIN[...]` gives a method options of its own: a speculator's setting against its
    default side by side; one-speculator chains may leave the speculator out of the key."""
    specs = parse_method_specs("suffix;suffix[max_spec_factor=0.5];"
                               "ngram_mod,suffix[ngram_mod.n_match=8, suffix.min_token_prob=0.2]",
                               tune_compare=True)
    assert [(n, t) for n, t, _ in specs] == [
        ("plain", []), ("suffix", ["suffix"]), ("suffix+tuned", ["suffix"]),
        ("suffix[max_spec_factor=0.5]", ["suffix"]), ("suffix[max_spec_factor=0.5]+tuned", ["suffix"]),
        ("ngram_mod,suffix[ngram_mod.n_match=8,suffix.min_token_prob=0.2]", ["ngram_mod", "suffix"]),
        ("ngram_mod,suffix[ngram_mod.n_match=8,suffix.min_token_prob=0.2]+tuned",
         ["ngram_mod", "suffix"])]
    options = {n: o for n, _, o in specs}
    assert options["suffix"] == {} and options["suffix[max_spec_factor=0.5]"] == {
        "suffix": {"max_spec_factor": 0.5}}
    assert options["ngram_mod,suffix[ngram_mod.n_match=8,suffix.min_token_prob=0.2]"] == {
        "ngram_mod": {"n_match": 8}, "suffix": {"min_token_prob": 0.2}}
    assert merge_spec_options({"suffix": {"max_tree_depth": 16}, "draft": {"model": "m"}},
                              {"suffix": {"max_spec_factor": 0.5}}) == {
        "suffix": {"max_tree_depth": 16, "max_spec_factor": 0.5}, "draft": {"model": "m"}}


@pytest.mark.parametrize("spec_type, message", [
    ("suffix;suffix", "'suffix' given twice"),
    ("suffix[max_spec_factor=0.5", "options go in one [...] at its end"),
    ("suffix]", "']' without '['"),
    ("suffix[]", "options go in one [...] at its end"),
    ("suffix[a=1][b=2]", "options go in one [...] at its end"),
    ("[max_spec_factor=0.5]", "options need speculators"),
    ("ngram_mod,suffix[n_match=8]", "must name its speculator"),
    ("suffix[ngram_mod.n_match=8]", "not one of its speculators"),
    ("suffix[bogus=1]", "unknown option(s) ['bogus']"),
    ("suffix[max_spec_factor]", "expected TYPE.KEY=VALUE"),
    ("nosuch[a=1]", "unknown speculator type 'nosuch'"),
])
def test_bad_method_options_are_refused_by_name(spec_type, message, capsys):
    """A malformed method, an option its speculators do not have, or a method given twice
    exits 2 naming it, before any model loads (live and replay runs alike)."""
    for extra in ([], ["--replay", "R"]):
        assert main(["bench", *extra, "--spec-type", spec_type]) == 2
        err = capsys.readouterr().err
        assert message in err and "--spec-type" in err


def test_replay_methods_with_their_own_options(tmp_path, capsys):
    """Replayed side by side, a speculator's option changes what it drafts: suffix trusting
    matches a quarter as far drafts fewer tokens per draft on the same records."""
    records = tmp_path / "records.jsonl"
    write_records(records)
    assert main(["bench", "--replay", str(records), "--spec-type",
                 "suffix;suffix[max_spec_factor=0.25]", "--categories", "summarization",
                 "--out-dir", str(tmp_path / "out")]) == 0
    report = last_json(capsys)
    assert report["methods"] == ["suffix", "suffix[max_spec_factor=0.25]"]
    assert report["method_options"] == {"suffix[max_spec_factor=0.25]": {
        "suffix": {"max_spec_factor": 0.25}}}
    rows = {r["method"]: r for r in report["results"]}
    full, short = rows["suffix"], rows["suffix[max_spec_factor=0.25]"]
    assert short["num_draft_tokens"] / short["num_drafts"] < full["num_draft_tokens"] / full["num_drafts"]


def test_replay_row_cost_prices_drafts(tmp_path, capsys):
    """A dearer verified row makes the chain draft fewer tokens and lowers the estimated speedup
    of the same acceptance; a free row estimates the mean accepted length itself."""
    records = tmp_path / "records.jsonl"
    write_records(records)
    reports = {}
    for cost in ("0", "0.3", "0.9"):
        assert main(["bench", "--replay", str(records), "--spec-type", "suffix", "--categories",
                     "summarization", "--replay-row-cost", cost,
                     "--out-dir", str(tmp_path / "out")]) == 0
        reports[cost] = last_json(capsys)
    free, mid, dear = (reports[c]["results"][0] for c in ("0", "0.3", "0.9"))
    assert reports["0.3"]["row_cost"] == 0.3
    decoded = free["num_generated"] - free["num_records"]
    assert free["est_speedup"] == pytest.approx(decoded / free["num_steps"], abs=1e-3)
    assert dear["num_draft_tokens"] < free["num_draft_tokens"]
    assert dear["est_speedup"] < mid["est_speedup"] < free["est_speedup"]


@pytest.mark.parametrize("argv, message", [
    (["--replay-row-cost", "0.2"], "applies only with --replay"),
    (["--replay", "R", "--replay-row-cost", "1.5"], "must be in [0, 1)"),
    (["--replay", "R", "--replay-row-cost", "-0.1"], "must be in [0, 1)"),
])
def test_replay_row_cost_bad_values(argv, message, capsys):
    """A bad --replay-row-cost exits 2 naming the flag and the problem, before reading records."""
    assert main(["bench", *argv, "--spec-type", "suffix"]) == 2
    err = capsys.readouterr().err
    assert "--replay-row-cost" in err and message in err


@pytest.mark.parametrize("argv, message", [
    (["--top-p", "0"], "top_p must be in (0, 1]"),
    (["--top-k", "-3"], "top_k must be >= 0"),
    (["--min-p", "2"], "min_p must be in [0, 1]"),
    (["--temperature", "-1"], "temperature must be in [0, 100]"),
])
def test_bad_sampling_flags_are_refused_by_name(argv, message, capsys):
    """A sampling flag out of range exits 2 naming it, before any model is loaded."""
    assert main(["bench", *argv, "--spec-type", "suffix"]) == 2
    err = capsys.readouterr().err
    assert "bad sampling flag" in err and message in err


# ---- peers -------------------------------------------------------------------------------------

class FakeServer(BaseHTTPRequestHandler):
    """A loopback OpenAI-compatible server: 0.05 s per generated token, optional timings.
    (Slow enough that a loaded machine's scheduling delays stay well inside the tolerances.)"""

    with_timings = False
    seconds_per_token = 0.05

    def do_GET(self):
        self._send({"data": [{"id": "fake-model"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n = body["max_tokens"]
        threading.Event().wait(self.seconds_per_token * n)
        reply = {"choices": [{"text": "x" * n}], "usage": {"completion_tokens": n}}
        if self.with_timings:
            reply["timings"] = {"predicted_per_second": 50.0, "prompt_n": 10, "prompt_ms": 20.0}
        self._send(reply)

    def _send(self, obj):
        data = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("with_timings, source", [(True, "server"), (False, "wall")])
def test_openai_peer(with_timings, source):
    """The server's own decode rate when it reports timings, else time(N) - time(1)."""
    from speculant.bench.openai_peer import run_openai_peer

    handler = type("Handler", (FakeServer,), {"with_timings": with_timings})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        (peer,) = run_openai_peer(url, {"qa": ["hello"]}, max_tokens=11, repeats=1, timeout_s=10)
    finally:
        server.shutdown()
    mean_request_s = peer.detail.pop("mean_request_s")
    assert peer.detail == {"url": url, "model": "fake-model", "timings_source": source}
    assert mean_request_s == pytest.approx(0.55, rel=0.5)
    assert peer.generated_tokens == 11 and peer.decode_tokens == [10]
    expected = 50.0 if with_timings else 20.0  # the server's own figure, else 10 tokens in 0.5 s
    assert peer.decode_tok_s == pytest.approx(expected, rel=0.5)


def test_openai_peer_at_concurrency():
    """At c=4 four requests are in flight: all their tokens over the wall time they took."""
    from speculant.bench.openai_peer import run_openai_peer

    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        one, four = run_openai_peer(url, {"qa": ["a", "b", "c", "d"]}, max_tokens=20, repeats=1,
                                    timeout_s=10, levels=(1, 4))
    finally:
        server.shutdown()
    assert four.name == one.name + " c=4" and four.detail["concurrency"] == 4
    assert four.decode_tokens == [80]
    assert four.decode_tok_s == pytest.approx(80.0, rel=0.5)  # 4 x 20 tokens in ~1 s


# ---- the command, end to end -------------------------------------------------------------------

def test_cli_end_to_end(tmp_path, capsys):
    """One short prompt, plain and a chain: the last stdout line is the documented JSON, and the
    recorded plain outputs replay."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "t1", "category": "qa", "mode": "chat",
                                   "turns": ["Name three primary colors."]}) + "\n")
    records = tmp_path / "rec.jsonl"
    threads = torch.get_num_threads()
    try:
        code = main(["bench", "--prompts", str(prompts), "--max-tokens", "8", "--concurrency", "1",
                     "--threads", "1", "--spec-type", "suffix", "--warmup-tokens", "2",
                     "--min-seconds", "60", "--max-repeats", "2",
                     "--record", str(records), "--no-interleave", "--out-dir", str(tmp_path / "out")])
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out.strip().splitlines()[-1])
    assert "qa c=1 suffix:" in captured.err and "median of 2 repeats" in captured.err
    assert set(report) == TOP_KEYS and report["methods"] == ["plain", "suffix"]
    assert report["sampling"] == {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
                                  "verify": "auto"}
    from speculant.kernels.native import tile_kv_cache

    auto_kv = "bfloat16" if tile_kv_cache() else "float16"  # the AMX tiles' layout where it runs
    assert (report["dtype"], report["kv_dtype"]) == ("auto", auto_kv)
    assert report["interleave_s"] is None  # --no-interleave: one engine, methods in turn
    # 8 tokens of plain decoding never add up to --min-seconds: the cell ran --max-repeats times
    assert (report["repeats"], report["min_seconds"], report["max_repeats"]) == (1, 60.0, 2)
    assert all(len(r["repeats_decode_tok_s"]) == 2 for r in report["results"])
    assert all(set(r) == RESULT_KEYS for r in report["results"])
    assert report["categories"]["qa"]["methods"]["suffix"]["1"]["identical_to_plain"] == 1
    for r in report["results"]:  # each accepted-length figure from the row's own counters
        steps, drafts, accepted = r["num_steps"], r["num_drafts"], r["num_accepted_tokens"]
        assert r["mean_accepted_length"] == pytest.approx(1 + accepted / steps, abs=1e-3)
        assert r["mean_accepted_length_per_draft"] == pytest.approx(
            1 + accepted / drafts if drafts else 1.0, abs=1e-3)
    row_costs = {r["method"]: r["row_cost"] for r in report["results"]}
    assert row_costs["plain"] is None and 0.0 < row_costs["suffix"] < 1.0
    by = {r["method"]: r for r in report["results"]}
    # one prompt at c=1: every token after the first was committed in a decode-only step
    gen = by["plain"]["generated_tokens"]
    assert by["plain"]["decode_coverage"] == round((gen - 1) / gen, 3)
    for r in report["results"]:
        assert 0.0 < r["decode_coverage"] <= 1.0 and r["request_decode_tok_s"] > 0
        assert len(r["repeats_request_decode_tok_s"]) == 2
    assert by["plain"]["request_speedup"] == 1.0 and by["suffix"]["request_speedup"] > 0
    assert report["files"]["chart"].endswith(".png")
    (rec,) = [json.loads(line) for line in records.read_text().splitlines()]
    assert set(rec) == {"id", "category", "prompt_ids", "output_ids"} and rec["id"] == "t1"
    assert len(rec["output_ids"]) == report["results"][0]["generated_tokens"]


def test_cli_tune_compare_runs_tuned_twins(tmp_path, capsys):
    """--tune-compare adds METHOD+tuned after each chain: the twin runs with the online tuner
    (its state is reported), the untuned chain without; both equal plain."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"t{i}", "category": "qa", "mode": "chat",
                                           "turns": [turn]}) + "\n"
                               for i, turn in enumerate(["Name three primary colors.",
                                                         "Count from one to ten."])))
    threads = torch.get_num_threads()
    try:
        code = main(["bench", "--prompts", str(prompts), "--max-tokens", "12", "--concurrency", "1",
                     "--threads", "1", "--spec-type", "suffix", "--warmup-tokens", "2",
                     "--tune-compare", "--min-seconds", "0", "--out-dir", str(tmp_path / "out")])
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out.strip().splitlines()[-1])
    assert report["methods"] == ["plain", "suffix", "suffix+tuned"]
    assert report["interleave_s"] == 0.1  # the default: three engines, side by side
    assert all(len(r["repeats_decode_tok_s"]) == 1 for r in report["results"])  # --min-seconds 0
    by = {r["method"]: r for r in report["results"]}
    assert by["suffix"]["tuner"] is None and by["plain"]["tuner"] is None
    assert by["suffix+tuned"]["tuner"]["1"]["steps"] > 0
    assert by["suffix"]["identical_to_plain"] == by["suffix+tuned"]["identical_to_plain"] == 2
    # two prompts ran side by side in each method: intervals over plain and over the twin
    assert by["plain"]["speedup_ci"] is None and by["suffix"]["vs_untuned_ci"] is None
    for r, ratio in ((by["suffix"], "speedup_ci"), (by["suffix+tuned"], "speedup_ci"),
                     (by["suffix+tuned"], "vs_untuned_ci")):
        lo, hi = r[ratio]
        assert 0 < lo <= hi
    assert "qa c=1 suffix: " in captured.err and "(95% CI " in captured.err


def test_cli_methods_with_options_run_on_engines_of_their_own(tmp_path, capsys):
    """A method with options of its own runs on its own engine, its speculator built with them
    (the JSON names them), beside the same speculator with its defaults; both equal plain."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "t1", "category": "qa", "mode": "chat",
                                   "turns": ["Name three primary colors."]}) + "\n")
    from speculant.bench import benchmark

    built = []
    original = benchmark._method_engines

    def spy(engine, args, specs):
        engines = original(engine, args, specs)
        built.append({name: e.speculator("suffix").config.min_token_prob
                      for name, e in engines.items() if name != "plain"})
        built.append(len({id(e) for e in engines.values()}))
        return engines

    threads = torch.get_num_threads()
    try:
        benchmark._method_engines = spy
        code = main(["bench", "--prompts", str(prompts), "--max-tokens", "8", "--concurrency", "1",
                     "--threads", "1", "--spec-type", "suffix;suffix[min_token_prob=0.5]",
                     "--warmup-tokens", "2", "--no-interleave", "--out-dir", str(tmp_path / "out")])
    finally:
        benchmark._method_engines = original
        torch.set_num_threads(threads)
    assert code == 0
    report = last_json(capsys)
    assert report["methods"] == ["plain", "suffix", "suffix[min_token_prob=0.5]"]
    assert report["method_options"] == {"suffix[min_token_prob=0.5]": {
        "suffix": {"min_token_prob": 0.5}}}
    assert built[0] == {"suffix": 0.1, "suffix[min_token_prob=0.5]": 0.5}
    assert built[1] == 2  # --no-interleave: plain and suffix share one, the option its own
    by = {r["method"]: r for r in report["results"]}
    assert by["suffix"]["identical_to_plain"] == by["suffix[min_token_prob=0.5]"]["identical_to_plain"] == 1


def test_short_cells_repeat_until_plain_was_timed_long_enough():
    """--repeats first, then more while plain's decode seconds add up to less than
    --min-seconds, never beyond --max-repeats."""
    assert wants_another_repeat([], 1, 8.0, 5)
    assert wants_another_repeat([2.0], 1, 8.0, 5) and wants_another_repeat([2.0, 3.0], 1, 8.0, 5)
    assert not wants_another_repeat([2.0, 3.0, 3.5], 1, 8.0, 5)  # 8.5 s timed
    assert not wants_another_repeat([9.0], 1, 8.0, 5)  # one long repeat is enough
    assert wants_another_repeat([9.0, 9.0], 3, 8.0, 5)  # --repeats 3 is a floor
    assert not wants_another_repeat([1.0] * 5, 1, 8.0, 5)  # the cap
    assert not wants_another_repeat([0.1], 1, 0.0, 5)  # --min-seconds 0: exactly --repeats


@pytest.mark.parametrize("argv, message", [
    (["--min-seconds", "-1"], "--min-seconds must be >= 0"),
    (["--min-seconds", "nan"], "--min-seconds must be >= 0"),
    (["--max-repeats", "0"], "--max-repeats must be >= 1"),
    (["--repeats", "3", "--max-repeats", "2"], "--max-repeats (2) must be >= --repeats (3)"),
])
def test_bad_repeat_flags_are_refused_by_name(argv, message, capsys):
    assert main(["bench", *argv, "--spec-type", "suffix"]) == 2
    assert message in capsys.readouterr().err


def test_tune_compare_does_not_apply_to_replay(capsys):
    assert main(["bench", "--replay", "R", "--tune-compare", "--spec-type", "suffix"]) == 2
    assert "--tune-compare" in capsys.readouterr().err


def test_interleave_turn_must_be_positive(capsys):
    assert main(["bench", "--interleave-seconds", "0"]) == 2
    assert "--interleave-seconds must be > 0" in capsys.readouterr().err
