"""Read only the tensors a process needs: a span's blocks on a node, the embeddings/norm/LM head on the gateway.

Readers speak Hugging Face tensor names (``model.layers.3.self_attn.q_proj.weight``) whatever the file format, and
record every name they materialise in ``loaded`` so tests can prove a node never touches another span's weights.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from safetensors import safe_open
from transformers import PretrainedConfig

from shared.errors import ModelLoadError
from shared.families import family_of
from shared.gguf_rewrites import CHECKS, REWRITES
from shared.model_source import ModelSource

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"


class WeightReader(Protocol):
    loaded: list[str]

    def names(self) -> set[str]: ...

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]: ...


class SafetensorsReader:
    """Tensors from safetensors files, located through the index when the checkpoint is sharded.

    ``fetch`` turns a file name of the checkpoint into a local path: the identity on a local folder, a hub download
    for a repo — so a hub model downloads only the shards that hold the requested tensors.
    """

    def __init__(self, fetch: Callable[[str], Path], has_file: Callable[[str], bool]) -> None:
        self._fetch = fetch
        self.loaded: list[str] = []
        if has_file(SAFETENSORS_INDEX):
            index = json.loads(fetch(SAFETENSORS_INDEX).read_text())
            self._file_of: dict[str, str] = dict(index["weight_map"])
        elif has_file(SAFETENSORS_SINGLE):
            with safe_open(str(fetch(SAFETENSORS_SINGLE)), framework="pt") as f:
                self._file_of = dict.fromkeys(f.keys(), SAFETENSORS_SINGLE)
        else:
            raise ModelLoadError(f"no {SAFETENSORS_INDEX} or {SAFETENSORS_SINGLE} in the checkpoint")

    def names(self) -> set[str]:
        return set(self._file_of)

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        by_file: dict[str, list[str]] = defaultdict(list)
        for name in names:
            if name not in self._file_of:
                raise ModelLoadError(f"tensor {name} is not in the checkpoint")
            by_file[self._file_of[name]].append(name)
        tensors: dict[str, torch.Tensor] = {}
        for file_name, file_names in by_file.items():
            with safe_open(str(self._fetch(file_name)), framework="pt") as f:
                for name in file_names:
                    tensors[name] = f.get_tensor(name)
                    self.loaded.append(name)
        return tensors


def local_folder_reader(folder: str) -> SafetensorsReader:
    root = Path(folder)
    return SafetensorsReader(fetch=lambda name: root / name, has_file=lambda name: (root / name).is_file())


def hub_reader(repo_id: str, revision: str | None) -> SafetensorsReader:
    """Hub checkpoint: downloads the index, then only the shards that hold what ``read`` is asked for."""
    from huggingface_hub import file_exists, hf_hub_download

    def fetch(name: str) -> Path:
        return Path(hf_hub_download(repo_id, name, revision=revision))

    def has_file(name: str) -> bool:
        return bool(file_exists(repo_id, name, revision=revision))

    return SafetensorsReader(fetch, has_file)


# transformers' fused experts of a block, which llama.cpp keeps as ``blk.{i}.ffn_{gate,up,down}_exps``.
_STACKED_EXPERTS = re.compile(r"^model\.layers\.(?P<block>\d+)\.mlp\.experts\.(?P<kind>gate_up_proj|down_proj)$")


class GgufReader:
    """Tensors of a ``.gguf`` file, dequantized to float32 with the ``gguf`` package.

    Names map through gguf's own HF↔GGUF tensor-name table, and Q/K rows are un-permuted for archs whose llama.cpp
    converter permuted them — the same two steps transformers applies when it loads a GGUF file.
    """

    def __init__(self, path: str, config: PretrainedConfig) -> None:
        import gguf

        from shared.gguf_file import read_gguf

        self._gguf = gguf
        self._config = config
        self._family = family_of(config)
        if not self._family.gguf_supported:
            raise ModelLoadError(f"GGUF files of the {self._family.name} family are not supported; use its safetensors")
        check = CHECKS.get(self._family.name)
        if check is not None:
            check(config, None)  # what the config alone rules out, before opening the file
        self.loaded: list[str] = []
        self._file = read_gguf(path)
        if check is not None:
            check(config, self._kv_heads())
        self._tensors = self._file.tensors
        arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == self._family.gguf_arch)
        self._name_map = gguf.get_tensor_name_map(arch, config.num_hidden_layers)

    def _kv_heads(self) -> int | None:
        value = self._file.metadata.get(f"{self._family.gguf_arch}.attention.head_count_kv")
        if isinstance(value, tuple):  # one count per layer: the check needs the first layer's
            value = value[0]
        return None if value is None else int(value)

    def _gguf_names(self, hf_name: str) -> tuple[str, ...] | None:
        """The GGUF tensors ``hf_name`` is made of (several for fused experts), or None if the file lacks them."""
        stacked = _STACKED_EXPERTS.match(hf_name)
        if stacked is not None:  # llama.cpp stacks each expert projection of a block in one [E, out, in] tensor
            kinds = ("gate", "up") if stacked["kind"] == "gate_up_proj" else ("down",)
            names = tuple(f"blk.{stacked['block']}.ffn_{kind}_exps.weight" for kind in kinds)
            return names if all(name in self._tensors for name in names) else None
        # gguf's table names some tensors without the base model's prefix (BLOOM's ``word_embeddings_layernorm``).
        for candidate in (hf_name, hf_name.removeprefix("transformer.")):
            name = self._name_map.get_name(candidate, try_suffixes=(".weight", ".bias"))
            if name in self._tensors:
                return (name,)
        return None

    def names(self) -> set[str]:
        layout = self._family.layout
        blocks = range(self._config.num_hidden_layers)
        family = self._family
        candidates = [
            f"{layout.block_prefix(i)}{rest}" for i in blocks for rest in family.block_parameters(self._config, i)
        ]
        norms = [layout.final_norm, *([layout.embed_norm] if layout.embed_norm else [])]
        candidates += [layout.embed, layout.lm_head]
        candidates += [f"{norm}.{kind}" for norm in norms for kind in ("weight", "bias")]
        return {name for name in candidates if self._gguf_names(name) is not None}

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        tensors = {}
        for name in names:
            gguf_names = self._gguf_names(name)
            if gguf_names is None:
                raise ModelLoadError(f"tensor {name} is not in the GGUF file")
            # Fused gate/up experts [E, 2I, D]: each expert's gate rows, then its up rows (transformers' layout).
            parts = [self._dequantize(gguf_name) for gguf_name in gguf_names]
            weights = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)
            tensors[name] = torch.from_numpy(np.ascontiguousarray(weights))
            self.loaded.append(name)
        return tensors

    def _dequantize(self, gguf_name: str) -> np.ndarray:
        tensor = self._tensors[gguf_name]
        weights = self._gguf.quants.dequantize(tensor.data, tensor.kind).astype(np.float32).reshape(tensor.shape)
        if self._family.gguf_permutes_qk and (".attn_q." in gguf_name or ".attn_k." in gguf_name):
            heads = self._config.num_attention_heads
            if ".attn_k." in gguf_name:
                heads = self._config.num_key_value_heads
            weights = _unpermute_rotary_rows(weights, heads)
        rewrite = REWRITES.get(self._family.name)
        return weights if rewrite is None else rewrite(gguf_name, weights, self._config)


def _unpermute_rotary_rows(weights: np.ndarray, heads: int) -> np.ndarray:
    # llama.cpp's converter reorders each head's rows from HF's "first half / second half" rotary layout to
    # interleaved pairs: rows (h, i, pair) were written as (h, pair, i). Swapping the two axes back restores HF order.
    half = weights.shape[0] // heads // 2
    return weights.reshape(heads, half, 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


class PrefixedReader:
    """Adds the base model's prefix that a checkpoint left out: BLOOM's hub checkpoints name ``h.0.…`` and
    ``word_embeddings.weight`` what transformers (and our layouts) call ``transformer.h.0.…``."""

    def __init__(self, inner: WeightReader, prefix: str) -> None:
        self._inner, self._prefix = inner, prefix
        self.loaded: list[str] = []

    def names(self) -> set[str]:
        return {self._prefix + name for name in self._inner.names()}

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        inner = self._inner.read(name.removeprefix(self._prefix) for name in names)
        tensors = {self._prefix + name: tensor for name, tensor in inner.items()}
        self.loaded.extend(tensors)
        return tensors


def _with_layout_prefix(reader: WeightReader, config: PretrainedConfig) -> WeightReader:
    prefix = family_of(config).layout.blocks.partition(".")[0] + "."
    names = reader.names()
    if prefix == "model." or any(name.startswith(prefix) for name in names):
        return reader
    return PrefixedReader(reader, prefix)


def open_weights(source: ModelSource, config: PretrainedConfig) -> WeightReader:
    if source.kind == "gguf":
        return GgufReader(source.location, config)
    if source.kind == "folder":
        return _with_layout_prefix(local_folder_reader(source.location), config)
    return _with_layout_prefix(hub_reader(source.location, source.revision), config)
