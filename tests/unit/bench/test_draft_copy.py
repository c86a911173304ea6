"""bench/draft_copy.py: the bfloat16 copy of the served SmolLM2 that ``bench.wan_tokens``' draft mode drafts with,
and the teacher-forced agreement it reports as the draft's acceptance."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import PreTrainedModel

from bench.draft_copy import bfloat16_copy, greedy_agreement
from gateway.model.draft_model import DraftModel
from gateway.model.files import load_tokenizer
from shared.model_source import resolve_model
from tests.helpers.smollm2 import load_reference
from tests.tiny_models import GetTinyModel

PROMPT = [3, 17, 42, 9, 5]


def _greedy(model: PreTrainedModel, prompt: list[int], new_tokens: int) -> list[int]:
    with torch.inference_mode():
        output = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False)  # type: ignore[operator]
    return [int(t) for t in output[0, len(prompt) :]]


def test_a_model_agrees_with_its_own_greedy_tokens_everywhere_and_not_where_one_is_changed(
    tiny_model: GetTinyModel,
) -> None:
    model = tiny_model("llama").model
    tokens = _greedy(model, PROMPT, 12)
    assert greedy_agreement(model, PROMPT, tokens) == (12, 12)
    changed = [*tokens]
    changed[4] = (tokens[4] + 1) % model.config.vocab_size  # not the model's pick at position 4
    hits, positions = greedy_agreement(model, PROMPT, changed)
    assert positions == 12 and hits <= 11


@pytest.mark.slow
def test_the_copy_is_the_served_smollm2_in_bfloat16_and_the_gateway_takes_it_as_a_draft(
    smollm2_gguf: Path, tmp_path: Path
) -> None:
    folder = bfloat16_copy(smollm2_gguf, tmp_path / "draft")
    served = load_reference(smollm2_gguf)[0]
    saved = load_file(str(folder / "model.safetensors"))
    reference = served.state_dict()
    assert saved and all(tensor.dtype == torch.bfloat16 for tensor in saved.values())
    for name, tensor in saved.items():
        assert torch.equal(tensor, reference[name].to(torch.bfloat16)), name
    # refused with ModelLoadError if the tokenizer the copy carries were not the served model's
    draft = DraftModel.load(str(folder), load_tokenizer(resolve_model(str(smollm2_gguf))))
    prompt = [1, 9690, 198, 2683, 314, 253, 1378, 28, 2]
    tokens = _greedy(served, prompt, 16)
    hits, positions = greedy_agreement(draft.model, prompt, tokens)
    assert positions == 16 and hits >= 8  # a rounding of the served weights: it mostly picks the same tokens
