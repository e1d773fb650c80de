"""`LLM`: the offline Python API. `LLM(model=...).generate(prompts, params)`."""
from __future__ import annotations

from typing import Callable, Iterable

import torch

from speculant.engine.engine import Engine, StepUpdate
from speculant.engine.config import EngineConfig
from speculant.engine.request_output import RequestOutput, make_output
from speculant.engine.sampling_params import SamplingParams
from speculant.engine.scheduler import QueueFullError


class LLM:
    """Many prompts decoded together with continuous batching (requests join as others finish)."""

    def __init__(self, model: str = "default", **engine_options):
        self.engine = Engine(EngineConfig(model=model, **engine_options))
        self.tokenizer = self.engine.tokenizer

    @classmethod
    def from_engine(cls, engine: Engine) -> "LLM":
        """An LLM over an engine that is already loaded (no second model load)."""
        llm = cls.__new__(cls)
        llm.engine, llm.tokenizer = engine, engine.tokenizer
        return llm

    def chat_prompt(self, messages: list[dict] | list[str]) -> str:
        """Chat turns (dicts with role/content, or plain user strings) -> templated prompt."""
        msgs = [m if isinstance(m, dict) else {"role": "user", "content": m} for m in messages]
        return self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True)

    def generate(self, prompts: str | list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None,
                 on_update: Callable[[StepUpdate], None] | None = None,
                 hidden_layers: tuple[int, ...] = ()) -> list[RequestOutput]:
        """Generate for every prompt (continuous batching). `hidden_layers`: return, in each
        output's `hidden_states`, the target's residual stream after these layers for every
        token it processed (features for training drafter heads, captured during generation)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        return self._run(zip(prompts, params_list), on_update, tuple(hidden_layers))

    def hidden_states(self, prompt: str | list[int], layers: tuple[int, ...] | None = None
                      ) -> dict[int, torch.Tensor]:
        """The target's pre-norm hidden states for a prompt: layer -> [num_prompt_tokens,
        hidden] (default: the last layer, the input of the final norm, as the seeds'
        `llama_get_embeddings_pre_norm_ith`)."""
        if layers is None:
            layers = (self.engine.model_config.num_layers - 1,)
        params = SamplingParams(max_tokens=1, temperature=0.0, spec={"enabled": False})
        out = self._run([(prompt, params)], None, tuple(layers))[0]
        return out.hidden_states

    def _run(self, work: Iterable, on_update, hidden_layers: tuple[int, ...] = ()
             ) -> list[RequestOutput]:
        engine = self.engine
        pending = list(work)
        seqs = []
        next_i = 0
        while next_i < len(pending) or engine.has_unfinished():
            # Feed the queue as it drains: a request joins while others are running.
            while next_i < len(pending):
                prompt, p = pending[next_i]
                try:
                    seqs.append(engine.add_request(prompt, p, hidden_layers=hidden_layers))
                except QueueFullError:
                    break
                next_i += 1
            for update in engine.step():
                if on_update is not None:
                    on_update(update)
        outputs = [make_output(s, engine.output_text(s)) for s in seqs]
        if hidden_layers:
            for out, s in zip(outputs, seqs):
                out.hidden_states = engine.captured_hidden_states(s)
        for s in seqs:
            engine.release(s)
        return outputs
