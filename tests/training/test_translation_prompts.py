"""German translation requests for head data, built from Debian's fortunes-de / manpages-de."""
import gzip
import json

from speculant.training import translation_prompts as tp


def test_sentences_are_split_and_markup_paths_and_short_ones_dropped():
    text = ("Der Hund schläft den ganzen Tag unter dem Tisch in der Küche. Kurz. "
            "Siehe /usr/share/doc für weitere Informationen zu diesem Paket hier. "
            "Am Abend gehen die Kinder gemeinsam in den großen Park am Fluss.")
    assert tp.split_sentences(text) == [
        "Der Hund schläft den ganzen Tag unter dem Tisch in der Küche.",
        "Am Abend gehen die Kinder gemeinsam in den großen Park am Fluss."]


def test_fortune_records_are_read_one_by_one():
    text = ("Wer nichts tut, kann auch nichts falsch machen, sagt man so.\n%\n"
            "Ein kurzer Spruch\n%\nDas Leben ist wie eine Schachtel voller Pralinen, sagte er.\n")
    assert tp.fortune_sentences(text) == [
        "Wer nichts tut, kann auch nichts falsch machen, sagt man so.",
        "Das Leben ist wie eine Schachtel voller Pralinen, sagte er."]


def test_manpage_requests_are_dropped_and_escapes_become_characters():
    troff = (".TH LS 1\n.SH BESCHREIBUNG\n\\fBls\\fP listet die Dateien im \\(Bqaktuellen\\(rq "
             "Verzeichnis auf und zeigt 64\\-Bit\\-Zeitstempel an.\n.PP\n")
    assert tp.manpage_sentences(troff) == [
        "ls listet die Dateien im „aktuellen“ Verzeichnis auf und zeigt 64-Bit-Zeitstempel an."]


def test_records_are_translation_requests_in_the_dev_format_and_seeded():
    sentences = [f"Dies ist der Beispielsatz Nummer {i} aus dem kleinen Test." for i in range(50)]
    records = tp.prompt_records(sentences, seed=3)
    assert records == tp.prompt_records(sentences, seed=3)
    assert records != tp.prompt_records(sentences, seed=4)
    assert {r["category"] for r in records} == {tp.CATEGORY}
    assert all(r["mode"] == "chat" and len(r["turns"]) == 1 for r in records)
    # every sentence once, each inside one of the templates
    prefixes = [t.split("{}")[0] for t, _ in tp.TEMPLATES]
    found = []
    for r in records:
        turn = r["turns"][0]
        prefix = next(p for p in prefixes if turn.startswith(p))
        found.append(turn[len(prefix):])
    assert sorted(found) == sorted(sentences)
    assert sum(r["turns"][0].startswith(prefixes[0]) for r in records) > len(records) / 3


def test_main_writes_prompts_from_unpacked_packages(tmp_path, capsys):
    fortunes = tmp_path / tp.FORTUNES_DIR
    fortunes.mkdir(parents=True)
    (fortunes / "kueche.u8").write_text(
        "Die Suppe muss eine halbe Stunde lang leise auf dem Herd köcheln.\n%\n"
        "Danach wird sie mit frischer Petersilie und etwas Pfeffer serviert.\n", encoding="utf-8")
    man1 = tmp_path / tp.MANPAGES_DIR / "man1"
    man1.mkdir(parents=True)
    with gzip.open(man1 / "cat.1.gz", "wt", encoding="utf-8") as f:
        f.write(".TH CAT 1\n\\fBcat\\fP verkettet Dateien und gibt sie auf der Standardausgabe "
                "aus.\n")
    out = tmp_path / "de.jsonl"
    assert tp.main(["--root", str(tmp_path), "--out", str(out), "--seed", "1"]) == 0
    records = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert len(records) == 3 and "3 translation prompts" in capsys.readouterr().out
    assert tp.main(["--root", str(tmp_path), "--out", str(out), "--limit", "2"]) == 0
    assert len(out.read_text(encoding="utf-8").splitlines()) == 2


def test_main_names_the_folder_without_german_text(tmp_path, capsys):
    assert tp.main(["--root", str(tmp_path), "--out", str(tmp_path / "x.jsonl")]) == 2
    assert str(tmp_path) in capsys.readouterr().err
