"""`speculant bench-pair`: two methods of one bench JSON, paired prompt by prompt (bench/pair.py)."""
import json

import pytest

from speculant.bench.confidence import paired_ratio_interval, paired_repeats_interval
from speculant.bench.pair import pair_methods
from speculant.cli.main import main


def result(method, category, conc, repeats):
    """A bench JSON result: `repeats` lists each repeat's per-prompt (tokens, seconds)."""
    rates = [sum(t for t, _ in r) / sum(s for _, s in r) for r in repeats]
    summed = [[sum(r[i][0] for r in repeats), sum(r[i][1] for r in repeats)]
              for i in range(len(repeats[0]))]
    return {"method": method, "category": category, "concurrency": conc,
            "num_prompts": len(repeats[0]), "repeats_decode_tok_s": rates, "speedup": 1.0,
            "prompt_decode": summed, "prompt_decode_repeats": [[list(p) for p in r] for r in repeats]}


def prompts(scale, n=12, seed=0):
    """Per prompt (tokens, seconds): `scale` x faster than a base whose prompts vary."""
    return [(50 + 7 * i, (50 + 7 * i) / 100.0 * (1 + 0.03 * ((i * 7 + seed) % 5 - 2)) / scale)
            for i in range(n)]


def report():
    base = [prompts(1.0), prompts(1.0, seed=1)]
    head = [prompts(1.1), prompts(1.1, seed=1)]
    return {"results": [result("chain", "qa", 1, base), result("chain,head", "qa", 1, head),
                        result("chain", "qa", 8, base), result("plain", "rag", 1, base)]}


def test_pairs_every_cell_both_methods_ran_with_the_bench_statistic_and_interval():
    rows = pair_methods(report(), "chain", "chain,head")
    assert [(r["category"], r["concurrency"]) for r in rows] == [("qa", 1)]  # c=8: no head run
    row = rows[0]
    assert row["ratio"] == pytest.approx(1.1, abs=1e-3)
    lo, hi = row["interval"]
    assert lo <= row["ratio"] <= hi
    rep = report()["results"]
    expected = paired_repeats_interval([[tuple(p) for p in r] for r in rep[1]["prompt_decode_repeats"]],
                                       [[tuple(p) for p in r] for r in rep[0]["prompt_decode_repeats"]])
    assert row["interval"] == [round(x, 3) for x in expected]


def test_a_json_without_per_repeat_lists_pairs_the_summed_ones():
    rep = report()
    for r in rep["results"]:
        del r["prompt_decode_repeats"]
    row = pair_methods(rep, "chain", "chain,head")[0]
    summed = [[tuple(p) for p in r["prompt_decode"]] for r in rep["results"][:2]]
    assert row["interval"] == [round(x, 3) for x in paired_ratio_interval(summed[1], summed[0])]


def test_the_cli_prints_the_table_or_json_and_names_what_is_wrong(tmp_path, capsys):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(report()))
    assert main(["bench-pair", str(path), "--base", "chain", "--method", "chain,head"]) == 0
    out = capsys.readouterr().out
    assert "chain,head / chain" in out and "| qa | 1 | 1.100 |" in out
    assert main(["bench-pair", str(path), "--base", "chain", "--method", "chain,head", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["ratio"] == pytest.approx(1.1, abs=1e-3)
    assert main(["bench-pair", str(path), "--base", "chain", "--method", "eagle3"]) == 2
    assert "'eagle3' is not in this run (it has: chain, chain,head, plain)" in capsys.readouterr().err
    assert main(["bench-pair", str(tmp_path / "missing.json"), "--base", "a", "--method", "b"]) == 2
    assert "no such file" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{\"no\": 1}")
    assert main(["bench-pair", str(tmp_path / "bad.json"), "--base", "a", "--method", "b"]) == 2
    assert "not a bench JSON" in capsys.readouterr().err
