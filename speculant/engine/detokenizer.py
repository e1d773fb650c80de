"""Incremental detokenization of one sequence's output, and stop strings found as text grows.

Decoding the whole output at every step costs O(length) per step, O(length^2) per request. A
`Detokenizer` decodes each new token inside a short window instead (vLLM's
`detokenize_incrementally`): the text a token adds is `decode(window + token)` minus
`decode(window)`, where the window holds the few tokens before it. A token that ends inside a
multi-byte character decodes to U+FFFD; its text is held until the character completes (or
`MAX_PENDING_TOKENS` tokens pass, when what is held is emitted as the full decode would show it).
The concatenated pieces equal `tokenizer.decode(output_ids)` for byte-level BPE vocabularies
(tested against the default model's tokenizer).

Stop strings are searched only in the new text plus the `longest stop - 1` characters before it,
so the work per token is bounded by the stop strings, not by the output.
"""
from __future__ import annotations

from dataclasses import dataclass

REPLACEMENT_CHAR = "\ufffd"
MAX_PENDING_TOKENS = 8  # tokens held for an incomplete character before they are emitted anyway


@dataclass(slots=True)
class StopHit:
    """A stop string completed by the last token pushed."""

    text_len: int  # output characters before the stop string (the text is cut there)


class Detokenizer:
    """Output text of one sequence, built token by token; the tokenizer is only ever asked to
    decode a window of a few tokens (`num_decoded_tokens` counts them, for tests)."""

    def __init__(self, tokenizer, stop: list[str] | tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self._max_stop = max((len(s) for s in self.stop), default=0)
        self._ids: list[int] = []  # the window: [prefix tokens | tokens whose text is held]
        self._read = 0  # self._ids[:_read] is the prefix, already emitted
        self._pieces: list[str] = []
        self._tail = ""  # the last `longest stop - 1` emitted characters
        self.num_chars = 0
        self.num_tokens = 0
        self.num_decoded_tokens = 0  # tokens passed to tokenizer.decode, summed over calls

    @property
    def text(self) -> str:
        """Everything emitted so far (text held for an incomplete character excluded)."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def push(self, token_id: int) -> tuple[str, StopHit | None]:
        """Add one token: the text it completes ("" while a character is incomplete), and the
        stop string it completes, if any (`text` is then cut where the stop string begins)."""
        self.num_tokens += 1
        self._ids.append(token_id)
        piece = self._next_piece()
        if not piece:
            return "", None
        hit = self._find_stop(piece)
        if hit is None:
            self._emit(piece)
            return piece, None
        # The text ends before the stop string, which may have begun in earlier pieces: callers
        # that stream must hold back a tail that could start a stop string (the server does).
        piece = piece[:max(0, hit.text_len - self.num_chars)]
        self._emit(piece)
        self._pieces = [self.text[:hit.text_len]]
        self.num_chars = hit.text_len
        return piece, hit

    def flush(self) -> str:
        """Emit text held for an incomplete character (the sequence ended)."""
        if len(self._ids) == self._read:
            return ""
        piece = self._decode(self._ids)[len(self._decode(self._ids[:self._read])):]
        self._ids, self._read = [], 0
        self._emit(piece)
        return piece

    def _next_piece(self) -> str:
        prefix_text = self._decode(self._ids[:self._read]) if self._read else ""
        full = self._decode(self._ids)
        pending = len(self._ids) - self._read
        if full.endswith(REPLACEMENT_CHAR) and pending < MAX_PENDING_TOKENS:
            return ""
        piece = full[len(prefix_text):]
        # The emitted tokens become the next window's prefix: a few tokens of left context keep
        # decoders that treat the first token specially (leading spaces) consistent.
        self._ids = self._ids[self._read:]
        self._read = len(self._ids)
        return piece

    def _find_stop(self, piece: str) -> StopHit | None:
        if not self.stop:
            return None
        window = self._tail + piece
        base = self.num_chars - len(self._tail)
        hits = [(i + len(s), i) for s in self.stop if (i := window.find(s)) >= 0]
        if not hits:
            return None
        _, start = min(hits)  # the stop string that ends first, as if tokens came one by one
        return StopHit(base + start)

    def _emit(self, piece: str) -> None:
        if not piece:
            return
        self._pieces.append(piece)
        self.num_chars += len(piece)
        if self._max_stop > 1:
            self._tail = (self._tail + piece)[-(self._max_stop - 1):]

    def _decode(self, ids: list[int]) -> str:
        self.num_decoded_tokens += len(ids)
        return self.tokenizer.decode(ids)
