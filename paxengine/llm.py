"""The offline API, in the style of vLLM: `LLM(...).generate(prompts, params)` and `.chat(...)`."""

from __future__ import annotations

import itertools

from tqdm import tqdm

from paxengine.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams, check
from paxengine.config import EngineConfig
from paxengine.engine import EngineCore
from paxengine.outputs import RequestOutput
from paxengine.sampling_params import SamplingParams


class LLM:
    """vLLM's offline entry point: `LLM("path/to/model", max_model_len=...)` or
    `LLM(model=...)` (an EngineConfig's fields as keywords), or `LLM(config, **overrides)`."""

    def __init__(self, model: str | EngineConfig | None = None, **overrides):
        if isinstance(model, EngineConfig):
            config = model
        else:
            config = overrides.pop("config", None)
            if model is not None:
                overrides["model"] = model
        cfg = (config or EngineConfig()).replace(**overrides)
        if cfg.kv_transfer_config:  # a prefill and a decode engine, stepped in turn
            from paxengine.disagg.roles import DisaggregatedCore

            self.engine = DisaggregatedCore(cfg)
        else:
            self.engine = EngineCore(cfg)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Drop the prefix cache's unused blocks (vLLM's); False while requests still run."""
        return self.engine.reset_prefix_cache()

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """prompts: a string, a list of strings, or dicts {"prompt": text} /
        {"prompt_token_ids": [...]} (vLLM's TextPrompt / TokensPrompt). sampling_params (vLLM's
        name; `params` too): one for all, or one a prompt."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if sampling_params is not None and params is not None:
            raise TypeError("give sampling_params or params (its older name), not both")
        params = sampling_params or params or SamplingParams()
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

    def beam_search(
        self,
        prompts: list,
        params: BeamSearchParams,
        lora_request=None,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's LLM.beam_search (paxengine/beam_search.py): prompts are strings or dicts
        {"prompt": text} / {"prompt_token_ids": [...]}; each iteration runs every live beam of
        `concurrency_limit` prompts (all: None) as one `generate` of one-token requests. As
        vLLM's, each sequence's tokens are the prompt's and the generated ones (EOS kept) and its
        text their decoding."""
        if lora_request is not None:
            raise ValueError("lora_request: LoRA adapters are not supported")
        params.validate()
        searches = []
        for p in prompts:
            _, ids = self.engine.tokenize_prompt(p)  # as generate tokenizes it
            check(self.engine, ids, params)
            searches.append(BeamSearch(ids, params, self.tokenizer.eos_token_ids, keep_eos=True))
        step = params.step_params()
        limit = concurrency_limit or max(1, len(searches))
        for start in range(0, len(searches), limit):
            batch = searches[start : start + limit]
            for _ in tqdm(range(params.max_tokens), desc="beam search", disable=not use_tqdm):
                live = [s for s in batch if not s.done]
                if not live:
                    break
                beams = [
                    {"prompt": None, "prompt_token_ids": b.tokens} for s in live for b in s.beams
                ]
                outs = iter(self.generate(beams, step, use_tqdm=False))
                for s in live:
                    s.extend([next(outs).outputs[0] for _ in s.beams])
        results = []
        for s in searches:
            best = s.best()
            for beam in best:
                beam.text = self.tokenizer.decode(beam.tokens, params.skip_special_tokens)
            results.append(BeamSearchOutput(best))
        return results

    def chat(
        self,
        messages,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: dict | None = None,
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """messages: one conversation (a list of {role, content}) or a list of them.
        continue_final_message (with add_generation_prompt=False): each answer goes on inside
        its conversation's last message; tools: OpenAI tool dicts the template shows, and
        chat_template: a Jinja template in place of the model's (vLLM's both);
        chat_template_kwargs: more template variables."""
        tok = self.tokenizer.with_chat_template(chat_template) if chat_template else self.tokenizer
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        options = dict(
            continue_final_message=continue_final_message, **(chat_template_kwargs or {})
        )
        if tools is not None:
            options["tools"] = tools
        prompts = [
            {
                "prompt": None,
                "prompt_token_ids": tok.encode_chat(c, add_generation_prompt, **options),
            }
            for c in convs
        ]
        return self.generate(prompts, sampling_params or params, use_tqdm)
