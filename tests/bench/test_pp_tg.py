"""`python -m speculant.bench.pp_tg`: llama-bench-style prefill (ppN) and decode (tgN) rates of the
engine, side by side with a llama-bench binary on the same GGUF.

llama.cpp itself is not built here; a stand-in script speaks llama-bench's command line and JSON
output, and records how it was called."""
from __future__ import annotations

import json
import os
import stat
import sys

import pytest

from speculant.bench import pp_tg
from speculant.kernels.native import kernel_path, prompt_attention, thread_team, vnni_wide_rows


def fake_llama_bench(tmp_path, exit_code: int = 0) -> tuple[str, str]:
    """An executable that answers like `llama-bench -o json` and logs its argv, one line a call."""
    log = tmp_path / "calls.jsonl"
    script = tmp_path / "llama-bench"
    script.write_text(f"""#!{sys.executable}
import json, sys
args = sys.argv[1:]
with open({str(log)!r}, "a") as f:
    f.write(json.dumps(args) + "\\n")
if {exit_code}:
    print("model load failed", file=sys.stderr)
    sys.exit({exit_code})
get = lambda flag: args[args.index(flag) + 1]
records = [{{"n_prompt": int(p), "n_gen": 0, "avg_ts": 100.0 + int(p)}} for p in get("-p").split(",")]
records.append({{"n_prompt": 0, "n_gen": int(get("-n")), "avg_ts": 50.0}})
records.append({{"n_prompt": 7, "n_gen": 7, "avg_ts": 1.0}})  # a pg test: not ours to compare
print(json.dumps(records))
""")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script), str(log)


def run_json(tmp_path, *argv) -> dict:
    out = tmp_path / "result.json"
    assert pp_tg.main([*argv, "--json-out", str(out)]) == 0
    return json.loads(out.read_text())


def test_prefill_and_decode_rates_of_the_active_path(tmp_path):
    result = run_json(tmp_path, "--pp", "24,40", "--tg", "6", "--repeats", "2")
    cells = {(r["engine"], r["test"]): r for r in result["results"]}
    engine = f"speculant:{kernel_path()}"
    assert set(cells) == {(engine, "pp24"), (engine, "pp40"), (engine, "tg6")}
    for cell in cells.values():
        assert len(cell["runs"]) == 2 and all(r > 0 for r in cell["runs"])
    assert result["machine"]["kernel_path"] == kernel_path()
    assert result["machine"]["prompt_attention"] == prompt_attention()
    assert result["machine"]["thread_team"] == thread_team() and thread_team() in ("pool", "openmp")
    assert result["machine"]["vnni_wide_rows"] == vnni_wide_rows()
    assert result["model"].endswith(".gguf")


def test_side_by_side_with_llama_bench_on_the_same_gguf(tmp_path, capsys):
    binary, log = fake_llama_bench(tmp_path)
    result = run_json(tmp_path, "--pp", "24", "--tg", "6", "--repeats", "3", "--threads", "1",
                      "--llama-bench", binary)
    cells = {(r["engine"], r["test"]): r for r in result["results"]}
    assert cells[("llama.cpp", "pp24")]["runs"] == [124.0] * 3
    assert cells[("llama.cpp", "tg6")]["runs"] == [50.0] * 3
    assert ("llama.cpp", "pg7") not in cells
    calls = [json.loads(line) for line in open(log)]
    assert len(calls) == 3  # once per repeat, interleaved with ours
    args = calls[0]
    assert args[args.index("-m") + 1] == result["model"]
    assert [args[args.index(f) + 1] for f in ("-p", "-n", "-t", "-r", "-o")] == \
        ["24", "6", "1", "1", "json"]
    table = capsys.readouterr().out
    assert "llama.cpp tok/s" in table and f"speculant:{kernel_path()} tok/s" in table


def test_a_failing_llama_bench_is_reported_not_hidden(tmp_path, capsys):
    binary, _ = fake_llama_bench(tmp_path, exit_code=3)
    assert pp_tg.main(["--pp", "8", "--tg", "0", "--repeats", "1", "--llama-bench", binary]) == 2
    err = capsys.readouterr().err
    assert "llama-bench failed (exit 3)" in err and "model load failed" in err


def test_an_unknown_kernel_path_is_named(capsys):
    assert pp_tg.main(["--pp", "8", "--tg", "0", "--repeats", "1", "--paths", "sse2"]) == 2
    assert "sse2: unknown kernel path" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--pp", "0"], "--pp lengths must be >= 1"),
    (["--pp", "512,x"], "--pp must be comma-separated integers"),
    (["--pp", "", "--tg", "0"], "nothing to measure"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--tg", "-1"], "--tg must be >= 0"),
    (["--llama-bench", "/nonexistent/llama-bench"], "is not an executable file"),
])
def test_bad_options_name_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        pp_tg.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_parse_llama_bench_rejects_non_json():
    with pytest.raises(RuntimeError, match="llama-bench printed no JSON"):
        pp_tg.parse_llama_bench("| model | size |")


def test_kv_cache_types_side_by_side(tmp_path):
    """--kv-dtypes runs one engine per KV cache type on the shared weights, each labelled."""
    result = run_json(tmp_path, "--pp", "24", "--tg", "0", "--repeats", "1",
                      "--kv-dtypes", "float16,float32")
    engines = {r["engine"] for r in result["results"]}
    assert engines == {f"speculant:{kernel_path()}:float16", f"speculant:{kernel_path()}:float32"}


def test_bad_kv_cache_type_is_refused_by_name(capsys):
    with pytest.raises(SystemExit) as exc:
        pp_tg.main(["--pp", "8", "--tg", "0", "--kv-dtypes", "float16,bf8"])
    assert exc.value.code == 2
    assert "--kv-dtypes: bf8 not one of" in capsys.readouterr().err
