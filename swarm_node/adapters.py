"""LoRA adapters on a span: each adapted linear layer adds its rows' own low-rank updates on top of the base layer.

The base layer stays as loaded (float, int8 or nf4: the update is computed in float beside it), so rows of other
adapters, and of none, run through the same weights in the same forward. Before each forward the span names each
row's adapter (``AdapterRows``); an adapted layer groups its rows by adapter and adds ``scale * B(A(x))`` to each
group's output.

Rows are the first dimension of a layer's input ([B, T, in]); a layer that sees them flattened ([B * T, in]) is
fine too. Modules inside routed experts see tokens regrouped by expert, so adapters targeting them are refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import nn

from shared.errors import ModelLoadError
from shared.lora import LoraAdapter, LoraPair, adapter_modules, load_adapter, read_config


class AdapterRows:
    """Which adapter each row of the running forward uses (None: the base model); set by the span per forward.

    The rows of each adapter are indexed once per forward, on the span's device, for every adapted layer to use."""

    def __init__(self) -> None:
        self.names: Sequence[str | None] = ()
        self._groups: dict[str, torch.Tensor] = {}

    def set(self, names: Sequence[str | None], device: torch.device | str = "cpu") -> None:
        self.names = names
        rows: dict[str, list[int]] = {}
        for row, name in enumerate(names):
            if name is not None:
                rows.setdefault(name, []).append(row)
        self._groups = {name: torch.tensor(indices, device=device) for name, indices in rows.items()}

    def clear(self) -> None:
        self.set(())

    def groups(self) -> dict[str, torch.Tensor]:
        """adapter -> indices of its rows (only adapters some row uses)."""
        return self._groups


class LoraLinear(nn.Module):
    """``base(x)`` plus, for each row whose adapter has a pair here, that pair's update."""

    def __init__(self, base: nn.Module, rows: AdapterRows) -> None:
        super().__init__()
        self.base = base
        self.rows = rows
        self.pairs: dict[str, LoraPair] = {}  # not parameters: the span's state dict stays the base model's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output: torch.Tensor = self.base(x)
        groups = {name: rows for name, rows in self.rows.groups().items() if name in self.pairs}
        if not groups:
            return output
        batch = len(self.rows.names)
        by_row = output.reshape(batch, -1, output.shape[-1])  # [B, tokens per row, out]
        inputs = x.reshape(batch, -1, x.shape[-1])  # [B, tokens per row, in]
        for name, rows in groups.items():
            delta = self.pairs[name].delta(inputs[rows]).to(output.dtype)
            by_row = by_row.index_add(0, rows, delta)
        return by_row.reshape(output.shape)


def block_modules(prefix: str, modules: set[str]) -> dict[str, str]:
    """{module name inside the block: its model-wide name} of the model-wide names under ``prefix``."""
    return {name.removeprefix(prefix): name for name in modules if name.startswith(prefix)}


def attach_adapters(
    layer: nn.Module,
    prefix: str,
    adapters: Sequence[LoraAdapter],
    rows: AdapterRows,
    device: torch.device,
    dtype: torch.dtype,
) -> None:
    """Wrap each linear of ``layer`` (block ``prefix``) that some adapter targets, and give it those pairs."""
    for adapter in adapters:
        for local, name in block_modules(prefix, set(adapter.pairs)).items():
            wrapped = _wrapped(layer, local, rows, name)
            pair = adapter.pairs[name]
            _check_shape(wrapped.base, pair, f"adapter {adapter.name}'s {name}")
            wrapped.pairs[adapter.name] = pair.to(device, dtype)


def _check_shape(base: nn.Module, pair: LoraPair, what: str) -> None:
    """An adapter of another model would fail mid-forward: refuse it at load (quantized layers keep the sizes too)."""
    sizes = getattr(base, "in_features", None), getattr(base, "out_features", None)
    if None not in sizes and (pair.a.shape[1], pair.b.shape[0]) != sizes:
        raise ModelLoadError(
            f"{what} maps {pair.a.shape[1]} -> {pair.b.shape[0]} features; the layer {sizes[0]} -> {sizes[1]}"
        )


def _wrapped(layer: nn.Module, local: str, rows: AdapterRows, name: str) -> LoraLinear:
    try:
        module = layer.get_submodule(local)
    except AttributeError:
        raise ModelLoadError(f"the adapter targets {name}, which this block has no module for") from None
    if isinstance(module, LoraLinear):
        return module
    if ".experts." in f".{local}." or local.endswith(".experts"):
        raise ModelLoadError(f"the adapter targets {name} inside routed experts, which is not served")
    parent_name, _, child = local.rpartition(".")
    parent = layer.get_submodule(parent_name) if parent_name else layer
    wrapped = LoraLinear(module, rows)
    setattr(parent, child, wrapped)
    return wrapped


def load_span_adapters(adapters: Mapping[str, Path], block_prefixes: Sequence[str]) -> list[LoraAdapter]:
    """Each adapter's pairs for the span's blocks (only their tensors are read); refuses what a span cannot serve:
    full replacements of block modules (``modules_to_save`` inside a block)."""
    loaded = []
    for name, folder in adapters.items():
        read_config(folder)
        _, replaced = adapter_modules(folder)
        inside = [module for module in replaced if any(module.startswith(prefix) for prefix in block_prefixes)]
        if inside:
            raise ModelLoadError(f"adapter {name} replaces block modules ({', '.join(sorted(inside))}): not served")
        loaded.append(load_adapter(name, folder, lambda m: any(m.startswith(p) for p in block_prefixes)))
    return loaded
