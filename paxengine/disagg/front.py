"""DisaggregatedEngine: the `EngineClient` of a prefill engine and a decode engine.

Each engine is an AsyncEngine with a thread of its own, so a long prefill never stalls a decode
step. A request goes to the prefill engine (its prompt and first token); the first token is
streamed to the client at once, the pages go to the decode engine (`roles.py`), and the decode
engine's outputs, which carry the whole completion, follow on the same stream: the client sees
one stream per request, as behind vLLM's P/D proxy.
"""

from __future__ import annotations

import dataclasses
from typing import AsyncIterator, Sequence

from paxengine.async_engine import AsyncEngine, _Mailbox
from paxengine.beam_search import BeamSearches
from paxengine.client import ModelInfo
from paxengine.config import EngineConfig
from paxengine.disagg.config import parse_kv_transfer_config
from paxengine.disagg.roles import Handoff, build_pair, check_disaggregable, disagg_stats
from paxengine.errors import EngineDead, InvalidRequest
from paxengine.outputs import RequestOutput
from paxengine.sampling_params import SamplingParams


class _DecodeEngine(AsyncEngine):
    """An AsyncEngine over a DecodeCore that also takes hand-offs, in order with the other
    messages of its inbox (an abort posted after a hand-off finds it)."""

    def resume(self, request_id: str, handoff: Handoff) -> AsyncIterator[RequestOutput]:
        self._check_alive()
        if request_id in self._streams:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        import asyncio

        q = _Mailbox()
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        self._post("handoff", request_id, handoff)
        return self._outputs(request_id, q)

    def other(self, kind: str, rid: str, payload) -> None:
        if kind != "handoff":
            return super().other(kind, rid, payload)
        try:
            self.core.receive(payload)
        except Exception as e:
            self.deliver([(rid, e)])


class DisaggregatedEngine(BeamSearches):
    """An `EngineClient` over a prefill and a decode engine (`kv_transfer_config`)."""

    def __init__(self, config: EngineConfig | None = None, **overrides):
        cfg = (config or EngineConfig()).replace(**overrides)
        kvt = parse_kv_transfer_config(cfg.kv_transfer_config, cfg.tensor_parallel_size)
        if kvt is None:
            raise ValueError("DisaggregatedEngine needs a kv_transfer_config")
        if cfg.data_parallel_size != 1:
            raise ValueError(
                "kv_transfer_config with data_parallel_size > 1 (several prefill or decode "
                "engines) is not implemented yet: one prefill and one decode engine"
            )
        self.config, self.kv_transfer_config = cfg, kvt
        prefill, decode, self.transfer = build_pair(cfg, kvt)
        self.prefill = AsyncEngine(prefill.config, core=prefill)
        self.decode = _DecodeEngine(decode.config, core=decode)
        self._live: set[str] = set()
        self._aborted: set[str] = set()  # aborted between the two engines

    # -- EngineClient ---------------------------------------------------------------------------
    @property
    def tokenizer(self):
        return self.prefill.tokenizer

    def model_info(self) -> ModelInfo:
        return self.prefill.model_info()

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        check_disaggregable(params)
        self.prefill.validate(prompt_token_ids, params)
        if getattr(params, "structured_outputs", None) is not None:
            self.decode.validate(prompt_token_ids, params)  # compiled there too (cached)

    def is_healthy(self) -> bool:
        return self.prefill.is_healthy() and self.decode.is_healthy()

    def stats(self) -> dict:
        return disagg_stats(self.prefill.stats(), self.decode.stats(), self.transfer)

    async def start(self) -> None:
        await self.prefill.start()
        await self.decode.start()

    async def shutdown(self) -> None:
        await self.prefill.shutdown()
        await self.decode.shutdown()

    async def reset_prefix_cache(self) -> bool:
        done = [await self.prefill.reset_prefix_cache(), await self.decode.reset_prefix_cache()]
        return all(done)

    def generate(
        self, request_id: str, prompt: str | Sequence[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        check_disaggregable(params)
        if not self.decode.is_healthy():  # its prompt would run for nothing
            raise EngineDead(f"the decode engine is not running ({self.decode.error!r})")
        if request_id in self._live:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        outputs = self.prefill.generate(request_id, prompt, params)  # raises before any output
        self._live.add(request_id)
        return self._stream(request_id, outputs)

    def engine_index(self, request_id: str) -> int:
        """A request's `engine` label on /metrics: the decode engine's ("1"), where it ends."""
        return 1

    async def abort(self, request_id: str) -> None:
        if request_id in self._live:
            self._aborted.add(request_id)
        await self.prefill.abort(request_id)
        await self.decode.abort(request_id)
        for step_id in self.beam_steps(request_id):  # a beam search's requests in flight
            await self.abort(step_id)

    # -- one request ----------------------------------------------------------------------------
    async def _stream(self, request_id: str, prefill_outputs) -> AsyncIterator[RequestOutput]:
        decode_outputs = None
        try:
            last = None
            async for out in prefill_outputs:
                last = out
                if not out.finished:
                    yield out
            handoff = self.prefill.core.handoffs.pop(request_id, None)
            if handoff is None:  # it ended with its first token (or was aborted)
                yield last
                return
            handoff.attach_output(last)
            first = handoff.first_output(self.tokenizer)
            yield first
            if request_id in self._aborted:
                yield _aborted(first)
                return
            decode_outputs = self.decode.resume(request_id, handoff)
            async for out in decode_outputs:
                yield out
        finally:
            # a consumer that went away: each engine's stream, closed now, aborts its request
            # there (not whenever the garbage collector finalizes it)
            await prefill_outputs.aclose()
            if decode_outputs is not None:
                await decode_outputs.aclose()
            self._live.discard(request_id)
            self._aborted.discard(request_id)
            self.prefill.core.handoffs.pop(request_id, None)


def _aborted(out: RequestOutput) -> RequestOutput:
    c = dataclasses.replace(out.outputs[0], finish_reason="abort")
    return dataclasses.replace(out, outputs=[c], finished=True)
