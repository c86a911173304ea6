"""PEFT LoRA adapters read from their own files: ``adapter_config.json`` + ``adapter_model.safetensors``.

Nodes and the gateway each read only the parts they compute: a node the low-rank pairs of its span's blocks, the
gateway those of the embeddings and the LM head (and their ``modules_to_save`` copies). Nothing is merged into the
base weights: a batch mixes rows of several adapters (and of none), each row adding its own ``scale * B(A(x))``.

PEFT names a module's pair ``base_model.model.<module>.lora_A.weight`` / ``lora_B.weight`` (an embedding's
``lora_embedding_A`` [r, V] / ``lora_embedding_B`` [D, r]), a module replaced whole (``modules_to_save``)
``<module>.weight``; ``<module>`` is the transformers model's own name (``model.layers.3.self_attn.q_proj``). The
update is scaled by ``lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA), per module where ``rank_pattern`` /
``alpha_pattern`` say so.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import torch
from pydantic import AfterValidator
from safetensors import safe_open

from shared.errors import ModelLoadError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_PAIR = re.compile(r"^(?P<module>.+)\.(?:lora_A|lora_B|lora_embedding_A|lora_embedding_B)(?:\.weight)?$")
# A module replaced whole (modules_to_save) is saved under its own name; a targeted embedding's base weight is saved
# too (``.base_layer.weight``, the base model's own tensor: ignored).
_SAVED = re.compile(r"^(?!.*(?:lora_|\.base_layer\.))(?P<module>.+)\.(?:weight|bias)$")


@dataclass(frozen=True)
class LoraPair:
    """One module's update ``scale * B @ A``: a [r, in] (an embedding's: [r, V]), b [out, r] (an embedding's [D, r])."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float

    def to(self, device: torch.device | str, dtype: torch.dtype) -> LoraPair:
        return LoraPair(self.a.to(device, dtype), self.b.to(device, dtype), self.scale)

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> scale * B(A(x)) [..., out], in the pair's dtype."""
        return (x.to(self.a.dtype) @ self.a.T @ self.b.T) * self.scale

    def embedding_delta(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] -> the embedding's update [..., D] (A's columns are the tokens)."""
        return (self.a.T[ids] @ self.b.T) * self.scale


@dataclass(frozen=True)
class LoraAdapter:
    """The parts of one adapter a process computes: low-rank pairs and replaced weights, by module name."""

    name: str
    pairs: dict[str, LoraPair] = field(default_factory=dict)
    replaced: dict[str, torch.Tensor] = field(default_factory=dict)  # modules_to_save: module -> its weight


def _checked_specs(specs: list[str]) -> list[str]:
    parse_adapter_specs(specs)
    return specs


# The ``--adapters NAME=PATH ...`` setting of both processes, checked when the settings are built.
AdapterSpecs = Annotated[list[str], AfterValidator(_checked_specs)]


def parse_adapter_specs(specs: list[str]) -> dict[str, Path]:
    """``NAME=PATH`` flags -> {name: folder}; names must be distinct, folders must hold a PEFT LoRA adapter."""
    adapters: dict[str, Path] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--adapters takes NAME=PATH, got {spec!r}")
        if name in adapters:
            raise ValueError(f"adapter name {name!r} given twice")
        adapters[name] = Path(path).expanduser()
    return adapters


def read_config(folder: Path) -> dict[str, Any]:
    """The adapter's config, refused unless it is a LoRA whose forward is ``W x + scale * B(A(x))``."""
    try:
        config: dict[str, Any] = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"cannot read the adapter config in {folder}: {error}") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise ModelLoadError(f"{folder} is a {config.get('peft_type')} adapter; only LoRA is served")
    unsupported = {
        "use_dora": bool(config.get("use_dora")),
        "lora_bias": bool(config.get("lora_bias")),
        "bias": config.get("bias", "none") != "none",
        "layer_replication": bool(config.get("layer_replication")),
        "target_parameters": bool(config.get("target_parameters")),
        "trainable_token_indices": bool(config.get("trainable_token_indices")),
        "alora_invocation_tokens": bool(config.get("alora_invocation_tokens")),
    }
    refused = [key for key, used in unsupported.items() if used]
    if refused:
        raise ModelLoadError(f"the adapter in {folder} uses {', '.join(refused)}, which is not served")
    return config


def _pattern_value(patterns: Mapping[str, Any], module: str, default: Any) -> Any:
    """PEFT's rank/alpha patterns: a key matches a module named by it or ending with ``.key`` (a regex)."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default


def module_scale(config: Mapping[str, Any], module: str) -> float:
    rank = int(_pattern_value(config.get("rank_pattern") or {}, module, config["r"]))
    alpha = float(_pattern_value(config.get("alpha_pattern") or {}, module, config["lora_alpha"]))
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def adapter_modules(folder: Path) -> tuple[set[str], set[str]]:
    """(modules with a LoRA pair, modules replaced whole) the adapter's weights name, without loading them."""
    with safe_open(str(folder / WEIGHTS_FILE), framework="pt") as weights:
        keys = list(weights.keys())
    return _modules_of(keys, _PAIR), _modules_of(keys, _SAVED)


def _modules_of(keys: list[str], pattern: re.Pattern[str]) -> set[str]:
    found = (pattern.match(key.removeprefix(_PREFIX)) for key in keys)
    return {match["module"] for match in found if match is not None}


def load_adapter(name: str, folder: Path, wanted: Callable[[str], bool]) -> LoraAdapter:
    """The adapter's pairs and replaced weights of the modules ``wanted`` accepts (only those tensors are read)."""
    config = read_config(folder)
    path = folder / WEIGHTS_FILE
    if not path.is_file():
        raise ModelLoadError(f"no {WEIGHTS_FILE} in {folder}")
    pairs: dict[str, LoraPair] = {}
    replaced: dict[str, torch.Tensor] = {}
    with safe_open(str(path), framework="pt") as weights:
        keys = {key.removeprefix(_PREFIX): key for key in weights.keys()}  # noqa: SIM118 (safe_open has no __iter__)
        for module in sorted(m for m in _modules_of(list(keys.values()), _PAIR) if wanted(m)):
            a, b = _pair_keys(module, keys)
            pairs[module] = LoraPair(weights.get_tensor(a), weights.get_tensor(b), module_scale(config, module))
        for module in sorted(m for m in _modules_of(list(keys.values()), _SAVED) if wanted(m)):
            if f"{module}.bias" in keys:
                raise ModelLoadError(f"the adapter replaces {module} with a bias, which is not served")
            replaced[module] = weights.get_tensor(keys[f"{module}.weight"])
    return LoraAdapter(name, pairs, replaced)


def _pair_keys(module: str, keys: Mapping[str, str]) -> tuple[str, str]:
    for a, b in ((".lora_A.weight", ".lora_B.weight"), (".lora_embedding_A", ".lora_embedding_B")):
        if module + a in keys and module + b in keys:
            return keys[module + a], keys[module + b]
    raise ModelLoadError(f"the adapter's {module} lacks its lora_A or lora_B tensor")
