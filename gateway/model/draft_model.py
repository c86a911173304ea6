"""A draft model at the gateway (``--speculative draft --draft-model PATH``): a small model of the same tokenizer,
loaded whole with transformers, that proposes the next k tokens greedily for the chain to verify.

Each generation has its own ``DraftSession``: a transformers ``DynamicCache`` over the tokens it has read. Before
drafting, the cache is cropped to the longest prefix it shares with the text so far (the drafts the chain rejected
go), the tokens after that prefix are read in one forward (a long catch-up, the prompt or rounds that drafted
nothing, in one of its own, not charged to the drafts), and k tokens are drafted one forward each. It runs in a
worker thread of its own (``asyncio.to_thread`` from the engine), never in the head batcher's: k forwards of a
model would hold up every other session's scoring. Greedy drafts are point masses q, so the engine's acceptance (the
request's own sampler, draft kept while the sample equals it) is the speculative sampling rule here too.

As a tree (``propose_tree``): the same greedy chain, and at each depth the draft model's second choice as a leaf
beside it — no forward more (the logits are those the chain was drafted from), one position more per depth, kept
by the decode plan where its chance pays for it (a draft model's second choice is often the served model's first).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from gateway.model.files import load_tokenizer
from gateway.model.speculation import DraftTree, ScoredTree, SpecTuner, common_prefix
from shared.errors import ModelLoadError
from shared.model_source import resolve_model

__all__ = ["DraftModel", "DraftSession"]

# Tokens a drafting round leaves the cache to read at most: its last draft and the token after (all kept). More are
# the prompt or the tokens of rounds that drafted nothing (the tuner's k = 0): read in a forward of their own,
# ``unpriced``, since charged per drafted token they would price a re-probing tuner's one draft out again.
ROUND_UNREAD = 2


class DraftModel:
    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model.eval()

    @classmethod
    def load(cls, path: str, tokenizer: PreTrainedTokenizerBase, cache_dir: Path | None = None) -> DraftModel:
        """The draft model at ``path`` (a folder, a GGUF file or a hub id, like MODEL) in float32; refused with
        ``ModelLoadError`` when its tokenizer is not the served model's (its drafts would be other tokens).
        ``cache_dir``: where a GGUF draft's converted tokenizer is kept (``load_tokenizer``)."""
        source = resolve_model(path)
        if load_tokenizer(source, cache_dir=cache_dir).get_vocab() != tokenizer.get_vocab():
            raise ModelLoadError(f"the draft model {path} has another tokenizer than the served model")
        model: PreTrainedModel = source.load(
            lambda location, **kwargs: AutoModelForCausalLM.from_pretrained(location, dtype=torch.float32, **kwargs),
            "the draft model",
        )
        return cls(model)

    def session(self, prompt_ids: Sequence[int], tuner: SpecTuner) -> DraftSession:
        return DraftSession(self.model, prompt_ids, tuner)


class DraftSession:
    """One generation's drafter over the draft model (its KV cache, the text so far)."""

    threaded = True  # ``propose`` runs k forwards: in a thread of its own

    def __init__(self, model: PreTrainedModel, prompt_ids: Sequence[int], tuner: SpecTuner) -> None:
        self._model = model
        self._cache = DynamicCache(config=model.config)
        self._read: list[int] = []  # the tokens whose keys and values the cache holds, in order
        self.context = list(prompt_ids)
        self.tuner = tuner
        self.unpriced = 0.0  # seconds of the last proposal spent catching the cache up (``Drafter.unpriced``)

    def emitted(self, token_id: int) -> None:
        self.context.append(token_id)

    def propose(self, k: int, after: Sequence[int] = (), forced: int = 0) -> list[int]:
        """Up to ``k`` greedy draft tokens after the text so far and then ``after`` (drafts already chosen; the
        model reads forced ones as any other)."""
        return [token for token, _ in self._drafted(k, after)]

    def propose_tree(self, depth: int, after: Sequence[int] = (), forced: int = 0) -> ScoredTree | None:
        """The greedy chain of ``depth`` drafts, each with the draft model's second choice as a sibling leaf; each
        node's share is the draft model's probability of it."""
        tokens: list[int] = []
        parents: list[int] = []
        shares: list[float] = []
        chain = -1  # the chain's last node so far
        for token, probabilities in self._drafted(depth, after):
            second = int(probabilities.topk(2).indices[1])
            tokens += [token, second]
            parents += [chain, chain]
            shares += [float(probabilities[token]), float(probabilities[second])]
            chain = len(tokens) - 2
        return ScoredTree(DraftTree(tokens, parents), shares) if tokens else None

    @torch.inference_mode()
    def _drafted(self, k: int, after: Sequence[int]) -> list[tuple[int, torch.Tensor]]:
        """Up to ``k`` greedy drafts, each with the draft model's probabilities [V] it was chosen from."""
        context = [*self.context, *after]
        if k <= 0 or not context:
            return []
        keep = min(common_prefix(self._read, context), len(context) - 1)  # at least one token to read
        if keep < len(self._read):
            self._forget(len(self._read) - keep)
        self.unpriced = 0.0
        behind = len(self.context) - keep  # tokens emitted that the cache has not read
        if behind > ROUND_UNREAD:  # the prompt, or rounds that drafted nothing: read apart from the drafting
            started, upto = time.perf_counter(), len(self.context) - 1
            self._model(input_ids=torch.tensor([context[keep:upto]]), cache=self._cache, use_cache=True)
            self._read += context[keep:upto]
            keep, self.unpriced = upto, time.perf_counter() - started
        drafts = [self._next(context[keep:])]
        while len(drafts) < k:
            drafts.append(self._next([drafts[-1][0]]))
        return drafts

    def _forget(self, count: int) -> None:
        """Drop the cache's last ``count`` tokens; a sliding-window cache that cannot roll back is rebuilt."""
        try:
            self._cache.crop(-count)  # this transformers' crop takes how many to remove, as a negative number
        except RuntimeError:
            self._cache, count = DynamicCache(config=self._model.config), len(self._read)
        del self._read[len(self._read) - count :]

    def _next(self, token_ids: list[int]) -> tuple[int, torch.Tensor]:
        """Read ``token_ids`` [T] into the cache -> the greedy token after them, and the probabilities [V]."""
        logits = self._model(input_ids=torch.tensor([token_ids]), cache=self._cache, use_cache=True).logits  # [1, T, V]
        self._read += token_ids
        return int(logits[0, -1].argmax()), torch.softmax(logits[0, -1].float(), dim=-1)
