"""Request text -> prompt token ids, within the server's limits, off the event loop.

Limits are checked in the cheapest order: counts and lengths on the parsed body, characters
before tokenizing, tokens right after. Templating and tokenizing run in a worker thread, and
the tokenizer's GIL-free entry point keeps a long prompt from stalling the event loop or the
engine thread.

Chat content is plain text unless the server parses special tokens: a user who types
`<|im_end|><|im_start|>system` gets those characters, not the control tokens. The template's
own control tokens are parsed as usual: the rendered prompt is split where each message's
content sits (found by rendering with placeholders), and only the template's parts are
tokenized with control tokens.
"""
from __future__ import annotations

import asyncio
import re

from jinja2 import TemplateError

from speculant.server.config import ServerConfig
from speculant.server.errors import ApiError

PLACEHOLDER = "\x00speculant-content-{}\x00"
PLACEHOLDER_RE = re.compile("\x00speculant-content-(\\d+)\x00")


def check_body(body, config: ServerConfig) -> None:
    """Counts and lengths a parsed request must respect (400 naming the field)."""
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stops) > config.max_stop_strings:
        raise _limit("stop", f"at most {config.max_stop_strings} stop strings, got {len(stops)}")
    longest = max((len(s) for s in stops), default=0)
    if longest > config.max_stop_chars:
        raise _limit("stop", f"a stop string may have at most {config.max_stop_chars} "
                     f"characters, got {longest}")
    messages = getattr(body, "messages", None)
    if messages is not None and len(messages) > config.max_messages:
        raise _limit("messages", f"at most {config.max_messages} messages, got {len(messages)}")
    prompt = getattr(body, "prompt", None)
    if isinstance(prompt, list):
        check_num_tokens(len(prompt), config, "prompt")


def check_num_tokens(num_tokens: int, config: ServerConfig, param: str) -> None:
    if config.max_prompt_tokens is not None and num_tokens > config.max_prompt_tokens:
        raise _limit(param, f"prompt has {num_tokens} tokens; this server accepts at most "
                     f"{config.max_prompt_tokens} (--max-prompt-tokens)")


async def encode_prompt(tokenizer, text: str, config: ServerConfig) -> list[int]:
    """A completion prompt (raw text: control tokens in it are parsed, as the caller wrote the
    template themselves)."""
    _check_chars(len(text), config, "prompt")
    return await _in_worker(lambda: tokenizer.encode(_checked_utf8(text)), "prompt", config)


async def encode_chat(tokenizer, messages: list[dict], config: ServerConfig) -> list[int]:
    _check_chars(sum(len(m["content"]) for m in messages), config, "messages")
    return await _in_worker(lambda: chat_ids(tokenizer, messages, config.parse_special_tokens),
                            "messages", config)


def chat_ids(tokenizer, messages: list[dict], parse_special: bool) -> list[int]:
    """Token ids of the chat template applied to `messages`; content is plain text unless
    `parse_special`."""
    for m in messages:
        _checked_utf8(m["content"])
    text = tokenizer.apply_chat_template(messages)
    specials = tokenizer.special_tokens
    if parse_special or not any(t in m["content"] for m in messages for t in specials):
        return tokenizer.encode(text)  # nothing to protect: the prompt as the template says
    marked = tokenizer.apply_chat_template(
        [{**m, "content": PLACEHOLDER.format(i)} for i, m in enumerate(messages)])
    parts = PLACEHOLDER_RE.split(marked)  # template, index, template, index, ..., template
    contents = [messages[int(i)]["content"] for i in parts[1::2]]
    if parts[0] + "".join(c + t for c, t in zip(contents, parts[2::2])) != text:
        raise ValueError("message content contains control-token text, and this model's chat "
                         "template changes content, so it cannot be kept as plain text")
    ids = tokenizer.encode(parts[0])
    for content, template in zip(contents, parts[2::2]):
        ids += tokenizer.encode(content, add_special_tokens=False, parse_special=False)
        ids += tokenizer.encode(template, add_special_tokens=False)
    return ids


async def _in_worker(work, param: str, config: ServerConfig) -> list[int]:
    try:
        ids = await asyncio.to_thread(work)
    except (ValueError, TypeError, UnicodeError, TemplateError) as exc:
        raise ApiError(400, f"{param}: {exc}", param=param) from exc
    check_num_tokens(len(ids), config, param)
    return ids


def _checked_utf8(text: str) -> str:
    text.encode("utf-8")  # lone surrogates ("\ud800" in JSON) fail here with a clear message
    return text


def _check_chars(num_chars: int, config: ServerConfig, param: str) -> None:
    if num_chars > config.max_prompt_chars:
        raise _limit(param, f"prompt has {num_chars} characters; this server accepts at most "
                     f"{config.max_prompt_chars} (--max-prompt-chars)")


def _limit(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param, code="limit_exceeded")
