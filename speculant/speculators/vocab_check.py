"""Can a draft model speculate for a target? The seed's vocabulary compatibility rules.

As llama.cpp's `common_speculative_are_compatible`: same vocabulary type, same BOS/EOS ids and
add-BOS flag, sizes within 128 tokens, and identical token text from id 5 on (ids below 5 are
special tokens that often differ harmlessly).
"""
from __future__ import annotations

MAX_VOCAB_SIZE_DIFFERENCE = 128
CHECK_START_TOKEN_ID = 5


class IncompatibleVocabError(ValueError):
    pass


def vocab_type(tokenizer) -> str:
    return type(tokenizer._tok.model).__name__


def check_vocab_compatible(tgt, dft) -> None:
    """Raise IncompatibleVocabError naming the first mismatch between two `Tokenizer`s."""
    checks = [
        ("vocabulary type", vocab_type(tgt), vocab_type(dft)),
        ("add-BOS flag", tgt.add_bos, dft.add_bos),
        ("BOS token id", tgt.bos_token_id, dft.bos_token_id),
        ("EOS token id", tgt.eos_token_id, dft.eos_token_id),
    ]
    for what, a, b in checks:
        if a != b:
            raise IncompatibleVocabError(f"draft model {what} differs: target {a!r}, draft {b!r}")
    n_tgt, n_dft = tgt.vocab_size, dft.vocab_size
    if abs(n_tgt - n_dft) > MAX_VOCAB_SIZE_DIFFERENCE:
        raise IncompatibleVocabError(
            f"draft vocabulary size {n_dft} differs from the target's {n_tgt} by more than "
            f"{MAX_VOCAB_SIZE_DIFFERENCE}")
    for i in range(CHECK_START_TOKEN_ID, min(n_tgt, n_dft)):
        a, b = tgt.id_to_token(i), dft.id_to_token(i)
        if a != b:
            raise IncompatibleVocabError(
                f"draft vocabulary differs at token {i}: target {a!r}, draft {b!r}")
