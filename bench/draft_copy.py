"""A lower-precision copy of the served SmolLM2 for ``--draft-model`` (issue 26: "a lower-precision copy of the
served model counts"), and how often its greedy token is the served model's.

The served model is the bundled Q4_1 GGUF, which the nodes dequantize to float32. The copy is those float32 weights
rounded to bfloat16 and saved as a safetensors folder with the GGUF's tokenizer: ``DraftModel.load`` takes a folder
and checks the tokenizer. transformers refuses ``save_pretrained`` on a GGUF-loaded model, so the weights are moved
into a model built ``from_config`` first (the field notes in shared/BRIEF.md).

    .venv/bin/python -m bench.draft_copy /tmp/smollm2-bf16   # writes the folder, prints its size
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel


def bfloat16_copy(gguf: Path, folder: Path) -> Path:
    """``folder`` holding the GGUF model's weights in bfloat16 and its tokenizer (written once, reused after)."""
    if (folder / "config.json").is_file():
        return folder
    served = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    copy = AutoModelForCausalLM.from_config(served.config, dtype=torch.bfloat16)
    copy.load_state_dict({name: tensor.to(torch.bfloat16) for name, tensor in served.state_dict().items()})
    copy.save_pretrained(folder)
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(folder)
    return folder


@torch.inference_mode()
def greedy_agreement(model: PreTrainedModel, prompt: Sequence[int], tokens: Sequence[int]) -> tuple[int, int]:
    """(positions where ``model``'s greedy token is the next of ``tokens``, positions): ``tokens`` being the served
    model's greedy output after ``prompt``, this is the draft's per-token acceptance under greedy verification."""
    ids = torch.tensor([[*prompt, *tokens]])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]  # [len(tokens), V]: each predicts the next token
    return int((logits.argmax(-1) == torch.tensor(tokens)).sum()), len(tokens)


def main() -> None:
    from bench.capacity import smollm2_path

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    args = parser.parse_args()
    folder = bfloat16_copy(smollm2_path(), args.folder)
    size = sum(path.stat().st_size for path in folder.glob("*.safetensors"))
    print(f"{folder}: {size / 2**20:.0f} MiB of bfloat16 weights")


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
