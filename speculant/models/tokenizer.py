"""The model's own tokenizer and chat template (HF `tokenizers`; GGUF vocabularies converted once).

A GGUF file carries its vocabulary, merges and chat template; transformers converts them to a
`tokenizer.json` (a few seconds, mostly importing transformers). We cache that conversion so
later loads take ~0.1 s and never import transformers.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from speculant.models.loader import ModelFiles, cache_root, file_key


@dataclass(slots=True)
class TokenizerFiles:
    tokenizer_json: str
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    add_bos: bool


class Tokenizer:
    """Encode / decode text and apply the chat template, exactly as the model's own files say."""

    def __init__(self, files: TokenizerFiles):
        from tokenizers import Tokenizer as HFTokenizer

        self._tok = HFTokenizer.from_file(files.tokenizer_json)
        self.chat_template = files.chat_template
        self.bos_token = files.bos_token
        self.eos_token = files.eos_token
        self.add_bos = files.add_bos
        self.bos_token_id = self._tok.token_to_id(files.bos_token) if files.bos_token else None
        self.eos_token_id = self._tok.token_to_id(files.eos_token) if files.eos_token else None
        self._template = None
        self._plain = None  # a twin that reads control-token text as plain text, made on use

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def special_tokens(self) -> tuple[str, ...]:
        """Texts of the control tokens (`<|im_end|>`, ...) that `encode` turns into their ids."""
        return tuple(t.content for t in self._tok.get_added_tokens_decoder().values() if t.special)

    def encode(self, text: str, add_special_tokens: bool = True,
               parse_special: bool = True) -> list[int]:
        """Token ids of `text`. `parse_special=False` encodes control-token text as plain text
        (user content can then never become a control token). The batch entry point releases
        the GIL while it works (plain `encode` holds it: a long text would stall every other
        Python thread, the server's event loop and engine included)."""
        tok = self._tok if parse_special else self._plain_tokenizer()
        ids = tok.encode_batch_fast([text], add_special_tokens=False)[0].ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id] + ids
        return ids

    def _plain_tokenizer(self):
        if self._plain is None:
            from tokenizers import Tokenizer as HFTokenizer

            plain = HFTokenizer.from_str(self._tok.to_str())
            plain.encode_special_tokens = True
            self._plain = plain
        return self._plain

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template; send a plain completion prompt")
        if not messages:
            raise ValueError("messages must not be empty")
        return self._compiled_template().render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "",
        )

    def _compiled_template(self):
        if self._template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            # The same environment transformers renders chat templates in.
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_template_error
            env.globals["strftime_now"] = _strftime_now
            self._template = env.from_string(self.chat_template)
        return self._template


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    import datetime

    return datetime.datetime.now().strftime(fmt)


def _raise_template_error(message: str):
    raise ValueError(f"chat template: {message}")


def load_tokenizer(files: ModelFiles) -> Tokenizer:
    if files.kind == "hf":
        return Tokenizer(_hf_folder_files(files.path))
    return Tokenizer(_gguf_tokenizer_files(files.path))


def _hf_folder_files(folder: str) -> TokenizerFiles:
    tokenizer_json = os.path.join(folder, "tokenizer.json")
    if not os.path.exists(tokenizer_json):
        raise FileNotFoundError(f"{folder!r} has no tokenizer.json")
    cfg = {}
    cfg_path = os.path.join(folder, "tokenizer_config.json")
    if os.path.exists(cfg_path):
        with open(cfg_path) as f:
            cfg = json.load(f)
    template = cfg.get("chat_template")
    jinja_path = os.path.join(folder, "chat_template.jinja")
    if template is None and os.path.exists(jinja_path):
        with open(jinja_path) as f:
            template = f.read()
    return TokenizerFiles(
        tokenizer_json=tokenizer_json,
        chat_template=template,
        bos_token=_token_text(cfg.get("bos_token")),
        eos_token=_token_text(cfg.get("eos_token")),
        add_bos=bool(cfg.get("add_bos_token", False)),
    )


def _token_text(token) -> str | None:
    if isinstance(token, dict):
        return token.get("content")
    return token


def _gguf_tokenizer_files(path: str) -> TokenizerFiles:
    return _hf_folder_files(gguf_tokenizer_folder(path))


def gguf_tokenizer_folder(path: str) -> str:
    """An HF tokenizer folder made once from a GGUF file's tokenizer (cached)."""
    folder = os.path.join(cache_root(), "tokenizers", file_key(path))
    if not os.path.exists(os.path.join(folder, "tokenizer.json")):
        _convert_gguf_tokenizer(path, folder)
    return folder


def _convert_gguf_tokenizer(path: str, folder: str) -> None:
    """One-time conversion through transformers' GGUF tokenizer converter."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    folder_of, name = os.path.dirname(path), os.path.basename(path)
    try:
        tok = AutoTokenizer.from_pretrained(folder_of, gguf_file=name)
    except ValueError as exc:
        # AutoTokenizer reads the model config first and knows no config for some GGUF
        # architectures (qwen3next); the vocabulary itself converts without one
        if "is not supported" not in str(exc):
            raise
        tok = PreTrainedTokenizerFast.from_pretrained(folder_of, gguf_file=name)
    tmp = folder + f".tmp{os.getpid()}"
    tok.save_pretrained(tmp)
    cfg_path = os.path.join(tmp, "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    # transformers' GGUF converter knows the file's add_bos flag; keep it explicit for our loader.
    cfg["add_bos_token"] = bool(getattr(tok, "add_bos_token", False))
    cfg.setdefault("bos_token", tok.bos_token)
    cfg.setdefault("eos_token", tok.eos_token)
    if tok.chat_template and "chat_template" not in cfg:
        cfg["chat_template"] = tok.chat_template
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    try:
        os.replace(tmp, folder)
    except OSError:  # another process finished the same conversion first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
