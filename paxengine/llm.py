"""The offline API, in the style of vLLM: `LLM(...).generate(prompts, params)` and `.chat(...)`."""

from __future__ import annotations

import itertools

from tqdm import tqdm

from paxengine.config import EngineConfig
from paxengine.engine import EngineCore
from paxengine.outputs import RequestOutput
from paxengine.sampling_params import SamplingParams


class LLM:
    def __init__(self, config: EngineConfig | None = None, **overrides):
        cfg = (config or EngineConfig()).replace(**overrides)
        if cfg.kv_transfer_config:  # a prefill and a decode engine, stepped in turn
            from paxengine.disagg.roles import DisaggregatedCore

            self.engine = DisaggregatedCore(cfg)
        else:
            self.engine = EngineCore(cfg)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts,
        params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """prompts: a string, a list of strings, or dicts {"prompt_token_ids": [...]}."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} sampling params")
        ids = [f"llm-{next(self._ids)}" for _ in prompts]
        added = []
        try:
            for rid, prompt, p in zip(ids, prompts, plist):
                self.engine.add_request(rid, prompt, p, final_only=True)
                added.append(rid)
        except Exception:
            for rid in added:
                self.engine.abort(rid)
            raise
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generating", disable=not use_tqdm, unit="req") as bar:
            while len(done) < len(ids):
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update()
        return [done[rid] for rid in ids]

    def chat(
        self,
        messages,
        params: SamplingParams | None = None,
        use_tqdm: bool = True,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """messages: one conversation (a list of {role, content}) or a list of them.
        continue_final_message (with add_generation_prompt=False): each answer goes on inside
        its conversation's last message; chat_template_kwargs: more template variables."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        options = dict(
            continue_final_message=continue_final_message, **(chat_template_kwargs or {})
        )
        prompts = [
            {
                "prompt": None,
                "prompt_token_ids": self.tokenizer.encode_chat(c, add_generation_prompt, **options),
            }
            for c in convs
        ]
        return self.generate(prompts, params, use_tqdm)
