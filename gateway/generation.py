"""The contract between the HTTP serving layer and the generation engine — plain Python, no torch, no hivemind.

The serving layer (``gateway.api``) sees only what is here: a request of token ids and sampling parameters in, a
stream of ``PromptCached`` and ``PromptScores`` (once each, when they apply) and ``GeneratedToken``s out, and a
``TokenCodec`` for text. The engine (``gateway.model.engine``) implements ``Engine``; tests may hand the serving
layer any other implementation.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

# (token id, logprob) pairs, most likely first.
TopLogprobs = tuple[tuple[int, float], ...]


# Temperatures below this are greedy (vLLM's threshold): dividing float32 logits by a tinier one gives inf, NaN.
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is picked from the logits; the defaults leave the model's distribution untouched."""

    temperature: float = 1.0  # 0 (or under GREEDY_BELOW): greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no limit
    min_p: float = 0.0  # drop tokens below min_p × the most likely token's probability
    seed: int | None = None
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from every token already generated
    frequency_penalty: float = 0.0  # OpenAI's: subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # transformers': divides logits of prompt and generated tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_k == 1

    def with_seed(self, seed: int | None) -> SamplingParams:
        return SamplingParams(**{**self.__dict__, "seed": seed})


@dataclass(frozen=True)
class Grammar:
    """What the generated text must match, as plain data: the serving layer writes it, the engine compiles it.

    ``json_schema``: a JSON schema (as JSON text); ``lark``: a Lark grammar in llguidance's dialect (which embeds
    schemas with ``%json {...}``); ``regex``: a regular expression. ``param`` names the request field it came from,
    for the 400 a grammar that does not compile earns.
    """

    kind: Literal["json_schema", "lark", "regex"]
    source: str
    param: str = "response_format"


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    ignore_eos: bool = False
    logprobs: int | None = None  # alternatives reported per generated token; None: no logprobs at all
    prompt_logprobs: int | None = None  # the same for every prompt token (echo); None: not computed
    # Whose conversation this is (an API key's id): a generation that ends well keeps its node caches for a later
    # request of the same scope that continues its tokens (a chat's next turn). None: nothing is kept or reused.
    reuse_scope: str | None = None
    grammar: Grammar | None = None  # constrained decoding: only tokens that keep the text within it are sampled
    adapter: str | None = None  # the LoRA adapter the request's ``model`` names (None: the base model)


@dataclass(frozen=True)
class GeneratedToken:
    token_id: int
    eos: bool  # an end-of-sequence token: the engine stops after it
    logprob: float | None = None  # of this token under the model's own (unprocessed) distribution
    top: TopLogprobs = ()  # the ``logprobs`` most likely tokens at this position


@dataclass(frozen=True)
class PromptScores:
    """Logprobs of each prompt token given the tokens before it; the first token has none (``None``)."""

    logprobs: list[float | None]
    top: list[TopLogprobs | None]


@dataclass(frozen=True)
class PromptCached:
    """The nodes already held the prompt's first ``tokens`` tokens (a kept conversation): only the rest was sent."""

    tokens: int


EngineEvent = PromptCached | PromptScores | GeneratedToken


@dataclass(frozen=True)
class ModelFacts:
    """What the served model is (for APIs that describe it: Ollama's /api/tags, /api/show)."""

    family: str  # transformers' model_type
    file_format: str  # gguf | safetensors
    size_bytes: int  # of its weight files (0: a hub id, files not ours)
    parameters: int  # of the whole model
    quantization: str  # Q4_1, F16, BF16, ...
    modified: float  # the files' newest mtime (epoch seconds)
    architecture: dict[str, Any]  # the config's scalar fields


class InvalidPrompt(ValueError):
    """The prompt cannot be built from what the client sent (the client's error, not the server's)."""


class InvalidGrammar(InvalidPrompt):
    """A response format or tool schema that cannot be compiled into a grammar."""

    def __init__(self, message: str, param: str = "response_format") -> None:
        super().__init__(message)
        self.param = param


class ChatTemplateMissing(InvalidPrompt):
    """The model's tokenizer has no chat template."""


class TokenCodec(Protocol):
    """Text ↔ token ids for the served model."""

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of the ids with special tokens left out (what a user reads)."""
        ...

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (may be part of a multi-byte character)."""
        ...

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The conversation as a prompt, with the model's chat template; raises ``ChatTemplateMissing``.

        ``tools``: OpenAI-style tool definitions for the template's ``tools`` variable; ``template_kwargs``: further
        template variables (``enable_thinking``)."""
        ...

    def chat_template(self) -> str | None:
        """The chat template's source (what tool-call and reasoning formats are guessed from), or None."""
        ...

    def fim_ids(self) -> tuple[int, int, int] | None:
        """(prefix, suffix, middle) fill-in-the-middle token ids, or None when the model has none."""
        ...


class Engine(Protocol):
    """What the serving layer needs of a generation engine."""

    @property
    def model_name(self) -> str: ...

    @property
    def context_length(self) -> int: ...

    @property
    def codec(self) -> TokenCodec: ...

    def stream(self, request: GenerationRequest) -> AsyncGenerator[EngineEvent, None]:
        """``PromptCached`` first when the prompt continued a kept conversation (``reuse_scope``), ``PromptScores``
        when ``prompt_logprobs`` is set, then one ``GeneratedToken`` per new token.

        Closing the iterator (or cancelling its consumer) ends the generation and closes its node sessions.
        """
        ...

    async def embed(self, inputs: Sequence[Sequence[int]], adapter: str | None = None) -> list[list[float]]:
        """One L2-normalized vector per input: the last block's output through the final norm, pooled as
        ``embedding_pooling`` says. No node holds the inputs' KV cache once this returns."""
        ...

    @property
    def embedding_pooling(self) -> Literal["last", "mean"]: ...

    @property
    def embedding_width(self) -> int:
        """The length of an embedding vector (the model's hidden size)."""
        ...

    async def model_facts(self) -> ModelFacts: ...

    async def missing_blocks(self) -> list[int]:
        """Blocks no live node serves now (empty: every request can be routed)."""
        ...

    async def served_adapters(self) -> list[str]:
        """The LoRA adapters this engine knows that live nodes serve for every block now (each a model of the API)."""
        ...

    async def announced_models(self) -> list[str]:
        """Names of the models nodes announce now (to tell an operator whose model name matches no node)."""
        ...

    async def swarm_report(self) -> dict[str, Any]:
        """The engine's view of the swarm as JSON-able data: per block who serves it, per node its state."""
        ...
