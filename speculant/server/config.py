"""Server configuration: request limits and prompt handling, one validated dataclass whose field
names are `speculant serve`'s flags (`--max-body-bytes`, ...).

Every limit is checked before any heavy work: the body size while it is read (413), the prompt's
characters before tokenization and its tokens right after (400), stop strings and message
counts when the body is parsed (400). The defaults admit any request the default model can run
(8192-token context) with a wide margin.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class ServerConfig:
    max_body_bytes: int = 4 * 1024 * 1024  # request body; beyond it: 413 before parsing
    body_timeout_s: float = 30.0  # a request body must arrive within this; else 408
    max_prompt_chars: int = 262_144  # prompt text, or all message contents, before tokenizing
    max_prompt_tokens: int | None = None  # None = the model's context length
    max_messages: int = 256  # messages in one chat request
    max_stop_strings: int = 4
    max_stop_chars: int = 256  # characters in one stop string
    # Chat message content is plain text by default: '<|im_end|>' typed by a user stays text
    # and can never close a turn or open a system turn. True parses control tokens in it.
    parse_special_tokens: bool = False

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_prompt_chars", "max_messages", "max_stop_strings",
                     "max_stop_chars"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.body_timeout_s > 0:
            raise ValueError(f"body_timeout_s must be > 0, got {self.body_timeout_s}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}")
