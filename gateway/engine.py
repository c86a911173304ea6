"""The generation engine: tokens in, tokens out, the blocks computed by the swarm.

    prompt ids ─embed→ hidden [1, T, D] ─ChainSession (node → node → …)→ hidden ─norm, LM head→ logits ─sample→ id

The prefill step returns the last block's hidden states for every prompt position, so prompt logprobs (``echo``)
cost one LM-head pass over them and no extra remote work. Torch work (embedding, LM head, sampling) runs in a
worker thread; the event loop only awaits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import torch
from hivemind import DHT
from hivemind.p2p import P2P
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from gateway.generation import EngineEvent, GeneratedToken, GenerationRequest, PromptScores, TopLogprobs
from gateway.model_files import load_head, load_tokenizer, stop_token_ids
from gateway.remote_session import ChainSession
from gateway.router import Router
from gateway.routing import RoutingMode
from gateway.sampling import Sampler, top_logprobs
from gateway.settings import EngineSettings
from gateway.swarm_report import swarm_report
from gateway.swarm_view import SwarmMonitor, SwarmView
from gateway.tokens import HFTokenCodec
from shared.dht_process import start_dht
from shared.head import ModelHead
from shared.membership import CallAuth
from shared.model_source import ModelSource, load_config, resolve_model

logger = logging.getLogger(__name__)

__all__ = ["GenerationEngine", "GenerationRequest"]

PROMPT_SCORE_CHUNK = 256  # prompt positions per LM-head pass when scoring a prompt (echo with logprobs)


class GenerationEngine:
    def __init__(
        self,
        settings: EngineSettings,
        source: ModelSource,
        config: PretrainedConfig,
        tokenizer: PreTrainedTokenizerBase,
        head: ModelHead,
    ) -> None:
        self.settings = settings
        self.source = source
        self.config = config
        self.tokenizer = tokenizer
        self.head = head
        self.stop_ids = stop_token_ids(config, tokenizer)
        self.context_length = int(config.max_position_embeddings)
        self.codec = HFTokenCodec(tokenizer, head.vocab_size)
        self._dht: DHT | None = None
        self._p2p: P2P | None = None
        self._monitor: SwarmMonitor | None = None
        self._router: Router | None = None

    @classmethod
    async def create(cls, settings: EngineSettings) -> GenerationEngine:
        # The DHT forks its own process: start it before torch spins up thread pools, which a fork must not copy.
        dht = start_dht(client_mode=True, **settings.dht_kwargs())
        if settings.num_threads:
            torch.set_num_threads(settings.num_threads)
        source = resolve_model(settings.model, settings.revision)
        config = await asyncio.to_thread(load_config, source)
        tokenizer, head = await asyncio.gather(
            asyncio.to_thread(load_tokenizer, source), asyncio.to_thread(load_head, source, config)
        )
        engine = cls(settings, source, config, tokenizer, head)
        await engine.start(dht)
        return engine

    @property
    def model_name(self) -> str:
        return self.source.name

    async def start(self, dht: DHT) -> None:
        self._dht = dht
        self._p2p = await self._dht.replicate_p2p()
        self._monitor = SwarmMonitor(
            self._dht, self.model_name, self.config.num_hidden_layers, self.settings.swarm_refresh
        )
        self._router = Router(
            self._monitor,
            self._p2p,
            RoutingMode(self.settings.routing),
            auth=CallAuth(self.settings.secret(), dht.peer_id.to_base58()),
            allowed_peers=frozenset(self.settings.allowed_peers) or None,
        )
        self._router.start()

    @property
    def router(self) -> Router:
        if self._router is None:
            raise RuntimeError("engine not started")
        return self._router

    async def close(self) -> None:
        if self._router is not None:
            await self._router.close()
        if self._dht is not None:
            await asyncio.to_thread(self._dht.shutdown)
            self._dht = None

    async def swarm_view(self, fresh: bool = False) -> SwarmView:
        """What routing sees: the DHT's records, less the nodes outside the allowlist (if any)."""
        return await self.router.view(fresh)

    async def missing_blocks(self) -> list[int]:
        return (await self.swarm_view()).missing_blocks()

    async def swarm_report(self) -> dict[str, Any]:
        view = await self.swarm_view()
        return swarm_report(self.model_name, view, dict(self.router.rtts), self.router.bans)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[int]:
        """Yield new token ids one by one; stops at max_new_tokens or an end-of-sequence token (yielded)."""
        async with contextlib.aclosing(self.stream(request)) as events:
            async for event in events:
                if isinstance(event, GeneratedToken):
                    yield event.token_id

    async def stream(self, request: GenerationRequest) -> AsyncGenerator[EngineEvent, None]:
        """``PromptScores`` first when asked, then each new token; stops after max_new_tokens or an EOS token."""
        if self._p2p is None:
            raise RuntimeError("engine not started")
        if request.max_new_tokens == 0 and request.prompt_logprobs is None:
            return  # nothing to compute: no session needed
        max_length = len(request.prompt_ids) + request.max_new_tokens
        sampler = Sampler(request.sampling, self.head.vocab_size, request.prompt_ids)
        async with ChainSession(self._p2p, self.router, max_length, self.settings.step_timeout) as chain:
            new_ids, position = request.prompt_ids, 0
            while True:
                hidden = await asyncio.to_thread(self._embed, new_ids)
                output = await chain.step(hidden, position)  # [1, T, D] after the last block
                if position == 0 and request.prompt_logprobs is not None:
                    yield await asyncio.to_thread(self._prompt_scores, output, new_ids, request.prompt_logprobs)
                position += len(new_ids)
                if position - len(request.prompt_ids) >= request.max_new_tokens:
                    return
                token = await asyncio.to_thread(self._next_token, output, sampler, request.logprobs)
                yield token
                if token.eos and not request.ignore_eos:
                    return
                new_ids = [token.token_id]

    def _embed(self, token_ids: list[int]) -> torch.Tensor:
        """-> hidden [1, T, D] in float32 (the wire dtype)."""
        return self.head.embed(torch.tensor([token_ids])).float()

    def _next_token(self, output: torch.Tensor, sampler: Sampler, num_logprobs: int | None) -> GeneratedToken:
        logits = self.head.logits(output[:, -1:])[0, -1]  # [V]
        token = sampler.next_token(logits)
        eos = token in self.stop_ids
        if num_logprobs is None:
            return GeneratedToken(token, eos)
        logprobs = torch.log_softmax(logits, dim=-1)  # [V]
        return GeneratedToken(token, eos, float(logprobs[token]), top_logprobs(logprobs, num_logprobs))

    def _prompt_scores(self, output: torch.Tensor, prompt_ids: list[int], k: int) -> PromptScores:
        """output: [1, T, D] of the prefill -> logprob of each prompt token given the ones before it.

        In chunks of positions: logits of a whole long prompt at once would take T × V floats (GBs at 8k tokens).
        """
        targets = torch.tensor(prompt_ids[1:], dtype=torch.long)  # [T-1]
        chosen: list[float | None] = [None]
        tops: list[TopLogprobs | None] = [None]
        for start in range(0, len(prompt_ids) - 1, PROMPT_SCORE_CHUNK):
            end = min(start + PROMPT_SCORE_CHUNK, len(prompt_ids) - 1)
            logprobs = torch.log_softmax(self.head.logits(output[:, start:end])[0], dim=-1)  # [chunk, V]
            chosen += logprobs.gather(-1, targets[start:end, None])[:, 0].tolist()
            tops += [top_logprobs(row, k) for row in logprobs]
        return PromptScores(chosen, tops)
