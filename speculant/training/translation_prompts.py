"""German-to-English translation requests for drafter-head data (`train-head --train-prompts`).

Why: the EAGLE-3 head agreed with the target on 0.15 of held-out translation tokens against
0.52-0.57 on chat, QA and maths (sitting 9). On "Translate German to English: ..." SmolLM2-135M
mostly copies the German sentence with small changes, a skill the head never saw: the ShareGPT
human turns hold ~30 German prompts in 52k, and 16% of what the target writes there lies outside
the draft vocabulary (German word pieces). Real German sentences come from two Debian packages
(fetched with `apt-get download fortunes-de manpages-de`, unpacked with `dpkg-deb -x`): the
fortune cookies (quotations, anecdotes) and the German manual pages, ~30k sentences. None of
them is a held-out prompt (those are Spec-Bench's WMT news sentences).

    python -m speculant.training.translation_prompts --root DIR --out FILE.jsonl

writes one record per sentence in the dev-prompt format (`category` "translation_de"), the
request phrased by one of a few templates.
"""
from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import random
import re
import sys

CATEGORY = "translation_de"
# (template, weight): mostly the phrasing users (and Spec-Bench) use, a few others
TEMPLATES = (("Translate German to English: {}", 6),
             ("Translate the following German text into English: {}", 2),
             ("What does this German sentence mean in English? {}", 1),
             ("Übersetze ins Englische: {}", 1))
FORTUNES_DIR = "usr/share/games/fortunes/de"
MANPAGES_DIR = "usr/share/man/de"
MIN_CHARS, MAX_CHARS = 40, 220
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-ZÄÖÜ])")
# troff escapes: a hyphen, quotes and dashes become their characters, fonts and spacing vanish
_TROFF_CHARS = {"\\-": "-", "\\(aq": "'", "\\(lq": "„", "\\(rq": "“", "\\(Bq": "„",
                "\\(Fo": "»", "\\(Fc": "«", "\\(em": " – ", "\\(en": "–", "\\(dq": '"'}
_TROFF_ESCAPE = re.compile(r"\\f[BIRP]|\\f\(\w\w|\\[&e]|\\\(\w\w|\\\*\(\w\w|\\[|^,/]")


def split_sentences(text: str, min_chars: int = MIN_CHARS, max_chars: int = MAX_CHARS,
                    min_letters: float = 0.75) -> list[str]:
    """Sentences of `text` (whitespace collapsed) between min_chars and max_chars long, mostly
    letters, without markup, paths or links."""
    out = []
    for sentence in _SENTENCE_END.split(re.sub(r"\s+", " ", text).strip()):
        sentence = sentence.strip()
        if not min_chars <= len(sentence) <= max_chars:
            continue
        if re.search(r"[<>|\\_@#={}\[\]$]|https?:|--|/\w", sentence):
            continue
        letters = sum(c.isalpha() or c == " " for c in sentence)
        if letters >= min_letters * len(sentence):
            out.append(sentence)
    return out


def fortune_sentences(text: str) -> list[str]:
    """Sentences of a fortune file (records separated by lines holding only '%')."""
    out = []
    for record in re.split(r"\n%\n", text):
        out += split_sentences(record)
    return out


def manpage_sentences(troff: str) -> list[str]:
    """Sentences of a man page's troff source: request lines dropped, font and character
    escapes removed."""
    text = " ".join(line for line in troff.splitlines() if not line.startswith((".", "'")))
    for escape, char in _TROFF_CHARS.items():
        text = text.replace(escape, char)
    return split_sentences(_TROFF_ESCAPE.sub("", text), min_letters=0.85)


def read_sentences(root: str) -> list[str]:
    """Every sentence of the unpacked packages under `root`, deduplicated, in a fixed order."""
    sentences: list[str] = []
    for path in sorted(glob.glob(os.path.join(root, FORTUNES_DIR, "*.u8"))):
        with open(path, encoding="utf-8", errors="replace") as f:
            sentences += fortune_sentences(f.read())
    for path in sorted(glob.glob(os.path.join(root, MANPAGES_DIR, "man*", "*.gz"))):
        with gzip.open(path, "rt", encoding="utf-8", errors="replace") as f:
            sentences += manpage_sentences(f.read())
    return list(dict.fromkeys(sentences))


def prompt_records(sentences: list[str], seed: int) -> list[dict]:
    """One translation request per sentence (shuffled), each phrased by a template drawn by
    weight."""
    rng = random.Random(seed)
    order = list(sentences)
    rng.shuffle(order)
    templates = [t for t, _ in TEMPLATES]
    weights = [w for _, w in TEMPLATES]
    return [{"id": f"{CATEGORY}-{i}", "category": CATEGORY, "source": "debian fortunes-de, "
             "manpages-de", "mode": "chat",
             "turns": [rng.choices(templates, weights)[0].format(s)]}
            for i, s in enumerate(order)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", required=True,
                   help="folder where fortunes-de and manpages-de are unpacked (dpkg-deb -x)")
    p.add_argument("--out", required=True, help="JSONL prompt file to write")
    p.add_argument("--limit", type=int, default=0, help="at most this many prompts (0 = all)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    sentences = read_sentences(args.root)
    if not sentences:
        print(f"translation_prompts: no German sentences under {args.root} (expected "
              f"{FORTUNES_DIR} or {MANPAGES_DIR})", file=sys.stderr)
        return 2
    records = prompt_records(sentences, args.seed)
    if args.limit > 0:
        records = records[:args.limit]
    with open(args.out, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(f"{len(records)} translation prompts from {len(sentences)} sentences -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
