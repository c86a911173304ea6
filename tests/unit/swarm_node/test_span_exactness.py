"""Spans of transformers' own decoder layers, driven with our KV cache, reproduce transformers exactly.

For every family: chains of spans split anywhere give the full model's hidden states and its greedy tokens;
sessions sharing span objects do not disturb each other, whether interleaved or batched at different lengths;
and stepping again from an earlier position (a rewind) gives what a fresh run gives.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from gateway.model.head import ModelHead, build_head
from shared.model_source import load_config, resolve_model
from shared.weights import open_weights
from swarm_node.kv_cache import SessionKV
from swarm_node.span import BlockSpan, build_span
from tests.tiny_models import NUM_LAYERS, VOCAB, GetTinyModel, TinyModel

MAX_LENGTH = 64
NEW_TOKENS = 20
ATOL = 1e-5

# Interior cut points of a chain over NUM_LAYERS (= 6) blocks: two chains of 2 spans, two of 3.
CHAINS = [(1,), (4,), (2, 3), (1, 5)]


@dataclass
class Chain:
    head: ModelHead
    spans: list[BlockSpan]

    def new_session(self) -> list[SessionKV]:
        return [span.new_session_kv(range(span.start, span.end), MAX_LENGTH) for span in self.spans]

    def forward(
        self,
        hidden: torch.Tensor,
        sessions: Sequence[list[SessionKV]],
        starts: Sequence[int],
        lengths: Sequence[int] | None = None,
        packed: bool = False,
    ) -> torch.Tensor:
        """hidden: [B, T, D], row b belongs to sessions[b] at positions starts[b]... -> last block's [B, T, D]."""
        for index, span in enumerate(self.spans):
            kvs = [session[index] for session in sessions]
            hidden = span(hidden, kvs, starts, range(span.start, span.end), lengths, packed=packed)
        return hidden

    def step(self, token_ids: torch.Tensor, session: list[SessionKV], start: int) -> torch.Tensor:
        """token_ids: [1, T] -> logits [1, T, V]."""
        return self.head.logits(self.forward(self.head.embed(token_ids), [session], [start]))

    def greedy(self, prompt: torch.Tensor, new_tokens: int) -> list[int]:
        """Prefill the prompt [1, T], then one token per step, each fed back."""
        session = self.new_session()
        logits = self.step(prompt, session, 0)
        position = prompt.shape[1]
        tokens: list[int] = []
        for _ in range(new_tokens):
            tokens.append(int(logits[0, -1].argmax()))
            logits = self.step(torch.tensor([tokens[-1:]]), session, position)
            position += 1
        return tokens


def build_chain(folder: Path, cuts: Sequence[int]) -> Chain:
    source = resolve_model(str(folder))
    config = load_config(source)
    reader = open_weights(source, config)
    bounds = [0, *cuts, config.num_hidden_layers]
    spans = [build_span(config, reader, start, end) for start, end in zip(bounds, bounds[1:], strict=False)]
    return Chain(build_head(config, reader), spans)


def random_ids(length: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (1, length), generator=generator)


@pytest.fixture
def tiny(tiny_model: GetTinyModel, tiny_variant: str) -> TinyModel:
    return tiny_model(tiny_variant)


@pytest.mark.parametrize("cuts", CHAINS, ids=lambda cuts: "cut" + "-".join(map(str, cuts)))
def test_chain_hidden_states_match_transformers(tiny: TinyModel, cuts: tuple[int, ...]) -> None:
    chain = build_chain(tiny.folder, cuts)
    ids = random_ids(13, seed=1)  # longer than the Mistral / Qwen2 sliding windows
    with torch.inference_mode():
        expected = tiny.model.base_model(ids).last_hidden_state
    hidden = chain.forward(chain.head.embed(ids), [chain.new_session()], [0])
    torch.testing.assert_close(chain.head.norm(hidden), expected, atol=ATOL, rtol=0)


# transformers' own greedy tokens after GREEDY_PROMPT, per tiny variant: every chain of a variant is compared with
# the same ones, so generate runs once a variant rather than once a chain (it is most of each test's time).
GREEDY_PROMPT = random_ids(7, seed=2)
GREEDY_REFERENCE: dict[str, list[int]] = {}


def reference_greedy(tiny: TinyModel, variant: str) -> list[int]:
    if variant not in GREEDY_REFERENCE:
        with torch.inference_mode():
            reference = tiny.model.generate(GREEDY_PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False)
        assert reference.shape[1] == GREEDY_PROMPT.shape[1] + NEW_TOKENS
        GREEDY_REFERENCE[variant] = reference[0, GREEDY_PROMPT.shape[1] :].tolist()
    return GREEDY_REFERENCE[variant]


@pytest.mark.parametrize("cuts", CHAINS, ids=lambda cuts: "cut" + "-".join(map(str, cuts)))
def test_chain_greedy_generation_matches_transformers(
    tiny: TinyModel, tiny_variant: str, cuts: tuple[int, ...]
) -> None:
    chain = build_chain(tiny.folder, cuts)
    assert chain.greedy(GREEDY_PROMPT, NEW_TOKENS) == reference_greedy(tiny, tiny_variant)


def test_interleaved_sessions_equal_each_alone(tiny: TinyModel) -> None:
    chain = build_chain(tiny.folder, (2, 4))
    prompts = [random_ids(5, seed=3), random_ids(9, seed=4)]

    def run(order: list[int]) -> dict[int, list[torch.Tensor]]:
        """Steps sessions in the given order (a session index per step); returns each session's logits."""
        sessions = {i: chain.new_session() for i in set(order)}
        positions = dict.fromkeys(sessions, 0)
        inputs = {i: prompts[i] for i in sessions}
        outputs: dict[int, list[torch.Tensor]] = {i: [] for i in sessions}
        for i in order:
            logits = chain.step(inputs[i], sessions[i], positions[i])
            outputs[i].append(logits)
            positions[i] += inputs[i].shape[1]
            inputs[i] = logits[:, -1:].argmax(-1)
        return outputs

    steps = 6
    together = run([0, 1] * steps)
    for i in (0, 1):
        alone = run([i] * steps)[i]
        assert len(alone) == len(together[i]) == steps
        for got, expected in zip(together[i], alone, strict=True):
            assert torch.equal(got, expected)


def test_batched_sessions_at_different_lengths_equal_each_alone(tiny: TinyModel) -> None:
    chain = build_chain(tiny.folder, (3,))
    prompts = [random_ids(length, seed=10 + length) for length in (3, 11, 6)]

    def prefill(prompt: torch.Tensor) -> tuple[list[SessionKV], int]:
        session = chain.new_session()
        token = int(chain.step(prompt, session, 0)[0, -1].argmax())
        return session, token

    batched = [prefill(prompt) for prompt in prompts]
    alone = [prefill(prompt) for prompt in prompts]
    sessions = [session for session, _ in batched]
    tokens = [token for _, token in batched]
    positions = [prompt.shape[1] for prompt in prompts]

    for _ in range(5):
        # One forward: B=3 rows of T=1, each at its own position (3, 11, 6 at first).
        hidden = chain.head.embed(torch.tensor(tokens).view(3, 1))
        logits = chain.head.logits(chain.forward(hidden, sessions, positions))
        for row, (session, token) in enumerate(alone):
            expected = chain.step(torch.tensor([[token]]), session, positions[row])
            torch.testing.assert_close(logits[row : row + 1], expected, atol=ATOL, rtol=0)
            alone[row] = (session, int(expected[0, -1].argmax()))
        tokens = [int(logits[row, -1].argmax()) for row in range(3)]
        assert tokens == [token for _, token in alone]
        positions = [position + 1 for position in positions]
        assert [kv.length for session in sessions for kv in session] == [p for p in positions for _ in chain.spans]


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_a_batch_of_rows_of_different_lengths_equals_each_row_alone(tiny: TinyModel, packed: bool) -> None:
    """Decode rows of one token beside verify rows of several (one of them rewinding over rejected drafts) in one
    forward: each row's outputs, and the keys/values it leaves for the next step, are what it gets alone."""
    chain = build_chain(tiny.folder, (2,))
    prompts = [random_ids(length, seed=20 + length) for length in (4, 9, 6)]
    batched = [chain.new_session() for _ in prompts]
    alone = [chain.new_session() for _ in prompts]
    for prompt, one, other in zip(prompts, batched, alone, strict=True):
        chain.step(prompt, one, 0)
        chain.step(prompt, other, 0)
    # Row 0 decodes one token; row 1 verifies four (a token and three drafts); row 2 rewinds two tokens of its
    # prompt and verifies three there.
    rows = [torch.tensor([[7]]), random_ids(4, seed=30), random_ids(3, seed=31)]
    starts = [4, 9, 4]
    lengths = [row.shape[1] for row in rows]
    ids = torch.zeros(3, max(lengths), dtype=torch.long)
    for index, row in enumerate(rows):
        ids[index, : row.shape[1]] = row[0]
    logits = chain.head.logits(chain.forward(chain.head.embed(ids), batched, starts, lengths, packed))
    for index, (row, start) in enumerate(zip(rows, starts, strict=True)):
        expected = chain.step(row, alone[index], start)
        torch.testing.assert_close(logits[index : index + 1, : row.shape[1]], expected, atol=ATOL, rtol=0)
        assert all(kv.length == start + row.shape[1] for kv in batched[index])
    # The next step of every session, batched as decode rows, sees exactly the keys/values each row stored.
    following = [start + length for start, length in zip(starts, lengths, strict=True)]
    logits = chain.head.logits(chain.forward(chain.head.embed(torch.tensor([[3], [5], [8]])), batched, following))
    for index, token in enumerate((3, 5, 8)):
        expected = chain.step(torch.tensor([[token]]), alone[index], following[index])
        torch.testing.assert_close(logits[index : index + 1], expected, atol=ATOL, rtol=0)


def test_rewind_overwrites_and_matches_a_fresh_run(tiny: TinyModel) -> None:
    chain = build_chain(tiny.folder, (1, 4))
    prompt = random_ids(10, seed=5)
    session = chain.new_session()
    chain.step(prompt, session, 0)
    for position in range(10, 15):  # five more tokens that the rewind will discard
        chain.step(torch.tensor([[position]]), session, position)

    # Rewind to position 6: replace the prompt's suffix with two other tokens, then decode one more.
    suffix = torch.tensor([[100, 101]])
    rewound = chain.step(suffix, session, 6)
    assert all(kv.length == 8 for kv in session)
    rewound_next = chain.step(torch.tensor([[102]]), session, 8)

    fresh = chain.new_session()
    expected = chain.step(torch.cat([prompt[:, :6], suffix], dim=1), fresh, 0)[:, 6:]
    expected_next = chain.step(torch.tensor([[102]]), fresh, 8)
    torch.testing.assert_close(rewound, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(rewound_next, expected_next, atol=ATOL, rtol=0)


def test_tiny_models_have_the_promised_shape(tiny: TinyModel) -> None:
    """Guards the fixtures themselves: every family is covered with the features the tests rely on."""
    config = tiny.model.config
    assert config.num_hidden_layers == NUM_LAYERS
    if config.model_type == "qwen2":
        assert tiny.model.model.layers[0].self_attn.q_proj.bias is not None
        assert "sliding_attention" in config.layer_types
    if config.model_type == "qwen3":
        assert hasattr(tiny.model.model.layers[0].self_attn, "q_norm")
