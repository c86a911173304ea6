"""What a model is, for APIs that describe it (Ollama's /api/tags and /api/show): family, file, size, parameters.

The parameter count comes from the architecture built on the meta device (nothing allocated), so it is the whole
model's, not the gateway's part of it.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from gateway.generation import ModelFacts
from shared.model_source import ModelSource

_GGUF_QUANT = re.compile(r"(?i)(?:^|[.\-_])((?:I?Q\d[A-Z0-9_]*)|F16|BF16|F32)$")


def model_facts(source: ModelSource, config: PretrainedConfig) -> ModelFacts:
    files = _files(source)
    return ModelFacts(
        family=str(config.model_type),
        file_format="gguf" if source.kind == "gguf" else "safetensors",
        size_bytes=sum(path.stat().st_size for path in files),
        parameters=_parameter_count(config),
        quantization=_quantization(source, config),
        modified=max((path.stat().st_mtime for path in files), default=0.0),
        architecture={key: value for key, value in config.to_dict().items() if isinstance(value, int | float | str)},
    )


def _files(source: ModelSource) -> list[Path]:
    path = Path(source.location)
    if path.is_file():
        return [path]
    if path.is_dir():
        return sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".bin", ".gguf"))
    return []  # a hub repo id: its files are in the cache, not ours to measure


def _parameter_count(config: PretrainedConfig) -> int:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(parameter.numel() for parameter in model.parameters())


def _quantization(source: ModelSource, config: PretrainedConfig) -> str:
    """A GGUF's type as its file name says (llama.cpp's naming: ``…Q4_1.gguf``); else the weights' dtype."""
    if source.kind == "gguf":
        found = _GGUF_QUANT.search(source.name)
        return found.group(1).upper() if found else "unknown"
    dtype = getattr(config, "torch_dtype", None) or getattr(config, "dtype", None) or "float32"
    return {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}.get(str(dtype).removeprefix("torch."), "F32")
