"""Request bodies of the OpenAI-compatible API (pydantic), and their translation to engine params.

Every model forbids unknown fields and coerces nothing (`strict`): a typo or a mistyped value is a
400 naming the field, never a silently ignored setting. A few OpenAI fields this server does not
implement are accepted only at their neutral value (`NEUTRAL_ONLY`), so clients that send the
defaults explicitly keep working; `user` is accepted and ignored.
"""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from speculant.engine.sampling_params import VERIFY_MODES, SamplingParams, SpecParams

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# Sane numeric ranges: below these, sampling turns into noise (1e-300 divides logits into
# infinities) rather than into a meaningful setting.
MIN_TEMPERATURE = 1e-3  # 0 is greedy; anything in (0, MIN_TEMPERATURE) is refused
MIN_REPEAT_PENALTY = 0.1

NonEmptyStr = Annotated[str, Field(min_length=1)]

# Field -> the only values accepted (the OpenAI default); anything else is refused by name.
NEUTRAL_ONLY = {
    "n": (None, 1),
    "best_of": (None, 1),
    "echo": (None, False),
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "suffix": (None, ""),
}


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class SpeculativeOptions(StrictModel):
    """Per-request speculation; unset fields take the server's `--spec-*` defaults."""

    enabled: bool = True
    type: list[NonEmptyStr] | NonEmptyStr | None = None  # subset of the loaded speculators
    n_max: int | None = Field(None, ge=0, le=256)
    n_min: int | None = Field(None, ge=0, le=256)
    p_min: float | None = Field(None, ge=0.0, le=1.0)
    verify: Literal[VERIFY_MODES] = "auto"

    @field_validator("type")
    @classmethod
    def _split_types(cls, value):
        if isinstance(value, str):
            value = [t.strip() for t in value.split(",") if t.strip()]
        if value is not None and not value:
            raise ValueError("must name at least one speculator (or omit it to use all)")
        return value

    def to_spec_params(self) -> SpecParams:
        return SpecParams(enabled=self.enabled, types=self.type, n_max=self.n_max,
                          n_min=self.n_min, p_min=self.p_min, verify=self.verify)


class StreamOptions(StrictModel):
    include_usage: bool = False


class SamplingFields(StrictModel):
    """Fields shared by completions and chat completions (None = the default)."""

    model: str = "default"
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=100.0)  # 0, or >= MIN_TEMPERATURE
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)  # llama.cpp
    min_p: float | None = Field(None, ge=0.0, le=1.0)  # llama.cpp
    repeat_penalty: float | None = Field(None, ge=MIN_REPEAT_PENALTY, le=10.0)  # llama.cpp
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: NonEmptyStr | list[NonEmptyStr] | None = None  # count and length: ServerConfig
    ignore_eos: bool = False  # llama.cpp / vLLM
    stream: bool = False
    stream_options: StreamOptions | None = None
    speculative: SpeculativeOptions | None = None
    user: str | None = None  # accepted and ignored
    n: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @field_validator(*NEUTRAL_ONLY, check_fields=False)
    @classmethod
    def _neutral_only(cls, value, info: ValidationInfo):
        allowed = NEUTRAL_ONLY[info.field_name]
        if not any(value == a and type(value) is type(a) for a in allowed):
            shown = " or ".join(repr(a) for a in allowed if a is not None)
            raise ValueError(f"only {shown} is supported (or omit the field)")
        return value

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, value):
        if value is not None and 0.0 < value < MIN_TEMPERATURE:
            raise ValueError(f"must be 0 (greedy) or at least {MIN_TEMPERATURE:g}")
        return value

    def max_tokens_for(self, num_prompt: int, max_model_len: int) -> int:
        return self.max_tokens or COMPLETION_DEFAULT_MAX_TOKENS

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """Engine parameters; raises ValueError (the engine's validation) on bad combinations."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        spec = self.speculative.to_spec_params() if self.speculative else SpecParams()
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=_or(self.temperature, 1.0),
            top_k=_or(self.top_k, 0),
            top_p=_or(self.top_p, 1.0),
            min_p=_or(self.min_p, 0.0),
            repetition_penalty=_or(self.repeat_penalty, 1.0),
            seed=self.seed, stop=stop, ignore_eos=self.ignore_eos, spec=spec)


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    best_of: int | None = None
    echo: bool | None = None
    logprobs: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value):
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            if len(value) != 1:
                raise ValueError(f"only one prompt per request is supported, got {len(value)}")
            value = value[0]
        if not value:
            raise ValueError("prompt must not be empty")
        if isinstance(value, list) and min(value) < 0:
            raise ValueError("prompt token ids must be >= 0")
        return value


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def template_dict(self) -> dict:
        """The message as a chat template expects it ('developer' is OpenAI's new 'system')."""
        text = self.content if isinstance(self.content, str) else "\n".join(
            p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = None

    def max_tokens_for(self, num_prompt: int, max_model_len: int) -> int:
        """Unset: whatever context is left (KV is taken as the output grows, not reserved:
        the scheduler preempts and later recomputes the newest sequence if blocks run out)."""
        return self.max_completion_tokens or self.max_tokens or max(1, max_model_len - num_prompt)


def _or(value, default):
    return default if value is None else value
