"""`LLM`: the offline Python API. `LLM(model=...).generate(prompts, params)`."""
from __future__ import annotations

from typing import Callable, Iterable

from speculant.engine import Engine, StepUpdate
from speculant.engine_config import EngineConfig
from speculant.request_output import RequestOutput, make_output
from speculant.sampling_params import SamplingParams
from speculant.scheduler import QueueFullError


class LLM:
    """Many prompts decoded together with continuous batching (requests join as others finish)."""

    def __init__(self, model: str = "default", **engine_options):
        self.engine = Engine(EngineConfig(model=model, **engine_options))
        self.tokenizer = self.engine.tokenizer

    def chat_prompt(self, messages: list[dict] | list[str]) -> str:
        """Chat turns (dicts with role/content, or plain user strings) -> templated prompt."""
        msgs = [m if isinstance(m, dict) else {"role": "user", "content": m} for m in messages]
        return self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True)

    def generate(self, prompts: str | list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None,
                 on_update: Callable[[StepUpdate], None] | None = None) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        return self._run(zip(prompts, params_list), on_update)

    def _run(self, work: Iterable, on_update) -> list[RequestOutput]:
        engine = self.engine
        pending = list(work)
        seqs = []
        next_i = 0
        while next_i < len(pending) or engine.has_unfinished():
            # Feed the queue as it drains: a request joins while others are running.
            while next_i < len(pending):
                prompt, p = pending[next_i]
                try:
                    seqs.append(engine.add_request(prompt, p))
                except QueueFullError:
                    break
                next_i += 1
            for update in engine.step():
                if on_update is not None:
                    on_update(update)
        outputs = [make_output(s, engine.output_text(s)) for s in seqs]
        for s in seqs:
            engine.release(s)
        return outputs
