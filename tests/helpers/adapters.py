"""PEFT LoRA adapters of tiny models, made by PEFT itself: the files nodes and the gateway load, and the reference."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import PreTrainedModel


class TinyAdapter(NamedTuple):
    folder: Path  # adapter_config.json + adapter_model.safetensors
    model: PeftModel  # the base model (a copy) with the adapter: PEFT's answer


def make_adapter(base: PreTrainedModel, folder: Path, seed: int, **lora: Any) -> TinyAdapter:
    """An adapter of ``base`` (left untouched) with random nonzero A and B, saved with ``save_pretrained``."""
    torch.manual_seed(seed)
    config = LoraConfig(init_lora_weights=False, **lora)
    with warnings.catch_warnings():  # PEFT warns when a tied embedding is targeted (the LM head stays the base's)
        warnings.simplefilter("ignore")
        model = get_peft_model(copy.deepcopy(base), config)
    with torch.no_grad():  # B starts random too (init_lora_weights=False), but small: make the update visible
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.normal_(0.0, 0.3)
    with warnings.catch_warnings():  # PEFT notes that it saves the embedding layers it targets
        warnings.simplefilter("ignore")
        model.save_pretrained(folder)
    return TinyAdapter(folder, model.eval())


# Two adapters unlike each other: one on attention and the down projection plus both gateway parts (rsLoRA, a
# per-module rank), one on the rest of the MLP and the other projections (a per-module alpha).
ADAPTER_ONE: dict[str, Any] = {
    "r": 4,
    "lora_alpha": 8,
    "target_modules": ["q_proj", "v_proj", "down_proj", "embed_tokens", "lm_head"],
    "use_rslora": True,
    "rank_pattern": {"v_proj": 2},
}
ADAPTER_TWO: dict[str, Any] = {
    "r": 2,
    "lora_alpha": 4,
    "target_modules": ["k_proj", "o_proj", "gate_proj", "up_proj"],
    "alpha_pattern": {"o_proj": 16},
}
