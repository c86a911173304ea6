"""The generation engine: tokens in, tokens out, the blocks computed by the swarm.

    prompt ids ─embed→ hidden [1, T, D] ─ChainSession (node → node → …)→ hidden ─norm, LM head→ logits ─sample→ id

The prefill step returns the last block's hidden states for every prompt position, so prompt logprobs (``echo``)
cost one LM-head pass over them and no extra remote work. Torch work (embedding, LM head, sampling) runs in a
worker thread; the event loop only awaits.

With speculation on (``gateway.model.speculation``), a step carries the last token and k draft tokens; the head
scores its k+1 positions at once, the request's sampler keeps the drafts that equal its picks, and the next step
starts at the first rejected position (which rewinds the nodes' caches there).

A request with a ``reuse_scope`` (a chat) that ends well leaves its chain open for a while
(``gateway.swarm.kept_chains``); a later prompt of the same scope that continues those tokens takes the chain,
grows it, rewinds it to the shared prefix and prefills only the rest — a chat's next turn costs its new tokens, not
the whole conversation.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any

import torch
from hivemind import DHT
from hivemind.p2p import P2P
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from gateway.generation import (
    EngineEvent,
    GeneratedToken,
    GenerationRequest,
    ModelFacts,
    PromptScores,
    TopLogprobs,
)
from gateway.model.decode_loop import Generation, Services
from gateway.model.draft_model import DraftModel
from gateway.model.embeddings import Pooling, embed_inputs, pooling_for
from gateway.model.facts import model_facts
from gateway.model.files import load_head, load_tokenizer, model_len, sampling_defaults, stop_token_ids
from gateway.model.grammar import GrammarCompiler
from gateway.model.head import ModelHead
from gateway.model.head_adapters import load_head_adapters
from gateway.model.head_batcher import HeadBatcher
from gateway.model.sampling import Sampler, top_logprobs
from gateway.model.speculation import DecodePlan, Drafter, SpecTuner
from gateway.model.suffix_drafts import OutputStore, SuffixDrafts
from gateway.model.tokens import HFTokenCodec, word_ids
from gateway.settings import EngineSettings
from gateway.swarm.chain_session import ChainSession
from gateway.swarm.conversations import Taken
from gateway.swarm.failover import FailoverPolicy
from gateway.swarm.kept_chains import KeptChains, Parked
from gateway.swarm.monitor import SwarmMonitor
from gateway.swarm.report import swarm_report
from gateway.swarm.router import Router
from gateway.swarm.routing import RoutingMode
from gateway.swarm.step_links import StepLinks
from gateway.swarm.verify.verifier import Verifier, VerifySettings
from gateway.swarm.view import SwarmView
from shared.dht_process import replicate_p2p, start_dht, stop_dht, until_dht_lost
from shared.dht_records import fetch_announced_models
from shared.errors import DhtLost
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
        self._model_len = model_len(config, settings.max_model_len)
        self.sampling_defaults: dict[str, float] = {}  # from generation_config.json (``create`` reads it)
        self.codec = HFTokenCodec(tokenizer, head.vocab_size)
        self.heads = HeadBatcher(head.logits)  # every session's next-token scoring, batched
        self._dht: DHT | None = None
        self._p2p: P2P | None = None
        self._monitor: SwarmMonitor | None = None
        self._router: Router | None = None
        self._kept: KeptChains | None = None
        self._links: StepLinks | None = None  # every session's decode steps, batched per node
        self._grammars: GrammarCompiler | None = None  # built on the first constrained request (about a second)
        self._grammars_lock = asyncio.Lock()
        self._generations = 0  # in flight, from their prefill on: speculation drafts only while alone
        self.draft_model: DraftModel | None = None  # with ``--speculative draft``
        self._facts: ModelFacts | None = None  # what /api/show says, read once
        # recent outputs of every generation here: suffix drafts read them, comparing tokens as words
        self.outputs = OutputStore(words=word_ids(tokenizer))

    @classmethod
    async def create(cls, settings: EngineSettings) -> GenerationEngine:
        # The DHT forks its own process: start it before torch spins up thread pools, which a fork must not copy.
        dht = start_dht(client_mode=True, **settings.dht_kwargs())
        if settings.num_threads:
            torch.set_num_threads(settings.num_threads)
        source = resolve_model(settings.model, settings.revision)

        # A GGUF's config and tokenizer (and a GGUF draft's) come from the config cache once converted
        # (shared.config_cache).
        cache_dir = settings.config_cache_folder()
        config = await asyncio.to_thread(load_config, source, cache_dir)
        tokenizer, head, defaults, adapters = await asyncio.gather(
            asyncio.to_thread(load_tokenizer, source, settings.chat_template, cache_dir),
            asyncio.to_thread(load_head, source, config),
            asyncio.to_thread(sampling_defaults, source),
            asyncio.to_thread(load_head_adapters, settings.adapter_folders(), config),
        )
        head.adapters = adapters
        engine = cls(settings, source, config, tokenizer, head)
        engine.sampling_defaults = defaults
        if settings.speculative == "draft" and settings.draft_model is not None:
            engine.draft_model = await asyncio.to_thread(DraftModel.load, settings.draft_model, tokenizer, cache_dir)
        try:
            await until_dht_lost(dht, engine.start(dht))  # a call into a dead DHT child would wait forever
        except DhtLost as lost:
            logger.error("%s while the gateway started; stopping", lost)
            stop_dht(dht)
            raise
        return engine

    @property
    def context_length(self) -> int:
        """Prompt + completion tokens a request may use: ``--max-model-len`` when given; else the model's window,
        or less when the swarm's nodes cannot hold that long a session (a request no chain could ever hold is a 400,
        not a wait for room that never comes). Follows the swarm as nodes come and go."""
        if self.settings.max_model_len is not None or self._router is None or self._router.last_view is None:
            return self._model_len
        longest = self._router.last_view.longest_session()
        return self._model_len if longest is None else min(self._model_len, longest)

    @property
    def model_name(self) -> str:
        return self.source.name

    async def start(self, dht: DHT) -> None:
        self._dht = dht
        self._p2p = await replicate_p2p(self._dht)
        self._monitor = SwarmMonitor(
            self._dht, self.model_name, self.config.num_hidden_layers, self.settings.swarm_refresh
        )
        auth = CallAuth(self.settings.secret(), dht.peer_id.to_base58())
        self._router = Router(
            self._monitor,
            self._p2p,
            RoutingMode(self.settings.routing),
            auth=auth,
            allowed_peers=frozenset(self.settings.allowed_peers) or None,
            verifier=Verifier(self._p2p, auth, self._verify_settings()) if self.settings.verify else None,
        )
        self._monitor.on_lookup = self._router.stats.record_lookup  # exported with the router's counters
        self._router.start()
        self._links = StepLinks(self._p2p, self.settings.step_timeout, self._router.liveness)
        self._kept = KeptChains(
            self._router.view, self.settings.conversation_keep_alive, self.settings.conversation_max_kept
        )
        self._kept.start()

    def _verify_settings(self) -> VerifySettings:
        return VerifySettings(
            check_rate=self.settings.verify_check_rate,
            threshold=self.settings.verify_threshold,
            max_checks=self.settings.verify_max_checks,
            timeout=self.settings.step_timeout,
            hidden_size=int(self.config.hidden_size),
            dtype=self.head.embed_tokens.weight.dtype,  # what the chain sends the first node
        )

    @property
    def router(self) -> Router:
        if self._router is None:
            raise RuntimeError("engine not started")
        return self._router

    async def close(self) -> None:
        if self._kept is not None:  # before the router: closing the chains frees the nodes' room
            await self._kept.close()
        await self.heads.close()
        if self._grammars is not None:
            self._grammars.close()
        if self._links is not None:
            await self._links.close()
        if self._router is not None:
            await self._router.close()
        if self._dht is not None:
            await asyncio.to_thread(stop_dht, self._dht)
            self._dht = None

    async def watch_dht(self) -> None:
        """Returns never; raises ``DhtLost`` once the DHT child or its p2pd has died."""
        assert self._dht is not None  # started in create()
        await until_dht_lost(self._dht, asyncio.get_running_loop().create_future())

    async def swarm_view(self, fresh: bool = False) -> SwarmView:
        """What routing sees: the DHT's records, less the nodes outside the allowlist (if any)."""
        return await self.router.view(fresh)

    async def missing_blocks(self) -> list[int]:
        return (await self.swarm_view()).missing_blocks()

    async def served_adapters(self) -> list[str]:
        view = await self.swarm_view()
        return [name for name in sorted(self.head.adapters) if not view.missing_blocks(name)]

    async def announced_models(self) -> list[str]:
        return await fetch_announced_models(self._dht) if self._dht is not None else []

    async def swarm_report(self) -> dict[str, Any]:
        view = await self.swarm_view()
        return swarm_report(
            self.model_name,
            view,
            dict(self.router.rtts),
            self.router.bans,
            self.router.stats,
            dict(self.router.waiting),
            self.router.verifier,
        )

    async def generate(self, request: GenerationRequest) -> AsyncIterator[int]:
        """Yield new token ids one by one; stops at max_new_tokens or an end-of-sequence token (yielded)."""
        async with contextlib.aclosing(self.stream(request)) as events:
            async for event in events:
                if isinstance(event, GeneratedToken):
                    yield event.token_id

    async def stream(self, request: GenerationRequest) -> AsyncGenerator[EngineEvent, None]:
        """``PromptCached`` when a kept conversation held part of the prompt, ``PromptScores`` when asked, then each
        new token; stops after max_new_tokens or an EOS token."""
        if request.max_new_tokens == 0 and request.prompt_logprobs is None:
            return  # nothing to compute: no session needed
        constraint = None
        if request.grammar is not None:  # compiled before any node is asked for room: a bad schema costs nothing
            constraint = await asyncio.to_thread((await self.grammars()).constraint, request.grammar)
        sampler = Sampler(request.sampling, self.head.vocab_size, request.prompt_ids, constraint)
        drafter = self._drafter(request)
        plan = DecodePlan(request, drafter, constraint)
        generation = Generation(request, self._services(request), sampler, plan, self.settings.speculative_trees)
        self._generations += 1  # from the prefill on: speculation drafts only while alone
        try:
            async with contextlib.aclosing(generation.run()) as events:
                async for event in events:
                    yield event
            if isinstance(drafter, SuffixDrafts):
                drafter.publish()  # later generations of the model draft from this output too
        finally:
            self._generations -= 1
            self.heads.forget(sampler)

    def _services(self, request: GenerationRequest) -> Services:
        """What one generation uses of the engine, bound to its request."""
        keep = None
        if request.reuse_scope is not None:
            keep = functools.partial(self.kept.keep, _kept_scope(request))
        return Services(
            heads=self.heads,
            prefill=functools.partial(self._prefill, request),
            embed=functools.partial(self._embed, adapter=request.adapter),
            prompt_scores=functools.partial(
                self._prompt_scores,
                prompt_ids=request.prompt_ids,
                k=request.prompt_logprobs or 0,
                adapter=request.adapter,
            ),
            round_trips=self._chain_rtts,
            others=lambda: self._generations - 1,
            keep=keep,
            stop_ids=self.stop_ids,
            frame_rtt=self._relay_rtt,
        )

    async def grammars(self) -> GrammarCompiler:
        async with self._grammars_lock:
            if self._grammars is None:
                self._grammars = await asyncio.to_thread(
                    GrammarCompiler, self.tokenizer, self.head.vocab_size, self.stop_ids
                )
            return self._grammars

    @property
    def kept(self) -> KeptChains:
        if self._kept is None:
            raise RuntimeError("engine not started")
        return self._kept

    async def _prefill(self, request: GenerationRequest) -> tuple[ChainSession, torch.Tensor, int]:
        """A chain holding the whole prompt, the last block's output [1, T, D] for the T prompt tokens it was just
        sent, and how many leading prompt tokens it held already (a kept conversation's)."""
        max_length = len(request.prompt_ids) + request.max_new_tokens
        if request.reuse_scope is not None and request.prompt_logprobs is None:  # scores need every position's output
            taken = self.kept.take(_kept_scope(request), request.prompt_ids)
            if taken is not None:
                output = await self._resume(taken, request.prompt_ids, max_length, request.adapter)
                if output is not None:
                    return taken.item.chain, output, taken.prefix
        chain = self._new_chain(max_length, request.adapter)
        await chain.open()
        try:
            hidden = await asyncio.to_thread(self._embed, request.prompt_ids, request.adapter)
            return chain, await chain.step(hidden, 0), 0
        except BaseException:
            await chain.close()
            raise

    def _new_chain(self, max_length: int, adapter: str | None) -> ChainSession:
        if self._p2p is None:
            raise RuntimeError("engine not started")
        return ChainSession(
            self._p2p,
            self.router,
            max_length,
            self.settings.step_timeout,
            links=self._links,
            failover=FailoverPolicy(wait=self.settings.failover_wait),
            push=self.settings.push,
            push_min_rtt=self.settings.push_min_rtt,
            adapter=adapter,
        )

    async def embed(self, inputs: Sequence[Sequence[int]], adapter: str | None = None) -> list[list[float]]:
        """One pooled, L2-normalized vector per input (``gateway.model.embeddings``); no node keeps its KV after."""
        return await embed_inputs(self._prefill_once, inputs, self.head.norm, self.embedding_pooling, adapter)

    @property
    def embedding_pooling(self) -> Pooling:
        return pooling_for(self.config, self.settings.embedding_pooling)

    @property
    def embedding_width(self) -> int:
        return int(self.config.hidden_size)

    async def model_facts(self) -> ModelFacts:
        if self._facts is None:
            self._facts = await asyncio.to_thread(model_facts, self.source, self.config)
        return self._facts

    async def _prefill_once(self, token_ids: Sequence[int], adapter: str | None) -> torch.Tensor:
        """The last block's output [1, T, D] for ``token_ids`` through a chain of its own, closed right after."""
        async with self._new_chain(len(token_ids), adapter) as chain:
            hidden = await asyncio.to_thread(self._embed, list(token_ids), adapter)
            return await chain.step(hidden, 0)

    async def _resume(
        self, taken: Taken[Parked], prompt_ids: list[int], max_length: int, adapter: str | None
    ) -> torch.Tensor | None:
        """Grow a kept chain to ``max_length`` and prefill the prompt after the shared prefix (the step rewinds the
        nodes there); None, with the chain closed, if that failed — e.g. a node expired the session meanwhile."""
        chain = taken.item.chain
        try:
            await taken.item.shrunk
            if chain.max_length != max_length:
                await chain.resize(max_length)
            hidden = await asyncio.to_thread(self._embed, prompt_ids[taken.prefix :], adapter)
            output = await chain.step(hidden, taken.prefix)
        except Exception as error:
            logger.warning("kept conversation unusable (%s); prefilling the whole prompt", error)
            await chain.close()
            return None
        except BaseException:
            await chain.close()
            raise
        logger.debug("resumed a kept conversation: %d prompt tokens cached", taken.prefix)
        return output

    def _embed(self, token_ids: list[int], adapter: str | None = None) -> torch.Tensor:
        """-> hidden [1, T, D] in float32 (the wire dtype), with ``adapter``'s embedding update if it has one."""
        return self.head.embed(torch.tensor([token_ids]), adapter).float()

    def _drafter(self, request: GenerationRequest) -> Drafter | None:
        if self.settings.speculative == "off":
            return None
        settings = self.settings
        tuner = SpecTuner(
            settings.speculative_max_k, settings.speculative_min_rtt, pipeline=settings.speculative_pipeline
        )
        if self.draft_model is not None:
            return self.draft_model.session(request.prompt_ids, tuner)
        return SuffixDrafts(request.prompt_ids, tuner, self.outputs)

    def _chain_rtts(self, chain: ChainSession) -> tuple[float, float]:
        """Seconds of round trips (a verify step's, a decode step's): relayed hop by hop, or pushed node to node when
        the chain pushes — gateway -> A -> B -> gateway costs (n + 1) / 2 round trips for n hops instead of n. A
        verify step is pushed like a decode step (so is the next one, rewinding over its rejected drafts)."""
        rtts = self.router.rtts
        relay = sum(rtts.get(hop.peer_id, 0.0) for hop in chain.hops)  # a node not yet measured counts 0
        hops = len(chain.hops)
        pushed = relay * (hops + 1) / (2 * hops) if chain.pushes_decode else relay
        return pushed, pushed

    def _relay_rtt(self, chain: ChainSession) -> tuple[float, int]:
        """Seconds of a relayed traversal's round trips (a pipelined frame's: one round trip per hop), and its hops."""
        return sum(self.router.rtts.get(hop.peer_id, 0.0) for hop in chain.hops), len(chain.hops)

    def _prompt_scores(
        self, output: torch.Tensor, prompt_ids: list[int], k: int, adapter: str | None = None
    ) -> PromptScores:
        """output: [1, T, D] of the prefill -> logprob of each prompt token given the ones before it.

        In chunks of positions: logits of a whole long prompt at once would take T × V floats (GBs at 8k tokens).
        """
        targets = torch.tensor(prompt_ids[1:], dtype=torch.long)  # [T-1]
        chosen: list[float | None] = [None]
        tops: list[TopLogprobs | None] = [None]
        for start in range(0, len(prompt_ids) - 1, PROMPT_SCORE_CHUNK):
            end = min(start + PROMPT_SCORE_CHUNK, len(prompt_ids) - 1)
            logits = self.head.logits(output[:, start:end], [adapter])[0]
            logprobs = torch.log_softmax(logits, dim=-1)  # [chunk, V]
            chosen += logprobs.gather(-1, targets[start:end, None])[:, 0].tolist()
            tops += [top_logprobs(row, k) for row in logprobs]
        return PromptScores(chosen, tops)


def _kept_scope(request: GenerationRequest) -> str:
    """Where a conversation's chain is kept: per caller and adapter (its nodes' caches hold that adapter's keys)."""
    scope = request.reuse_scope or ""
    return scope if request.adapter is None else f"{scope}\x00adapter:{request.adapter}"
