"""What a MODEL string names — a local Hugging Face folder, a ``.gguf`` file, or a hub repo — and its config.

The same MODEL string is given to nodes and to the gateway, and its ``name`` keys the model in the DHT and in the API.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypeVar

from transformers import AutoConfig, PretrainedConfig

from shared.errors import ModelLoadError

Loaded = TypeVar("Loaded")

SourceKind = Literal["folder", "gguf", "hub"]

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class ModelSource:
    kind: SourceKind
    location: str  # folder path, .gguf file path, or hub repo id
    revision: str | None = None

    @property
    def name(self) -> str:
        """The model's id: the folder's / repo's / GGUF file's base name."""
        base = self.location.rstrip("/").rsplit("/", 1)[-1]
        return base.removesuffix(".gguf") if self.kind == "gguf" else base

    def load(self, from_pretrained: Callable[..., Loaded], what: str) -> Loaded:
        """``from_pretrained`` (a transformers class's) on this source — a GGUF file is its folder + ``gguf_file``;
        a missing or unreadable file is a ``ModelLoadError`` naming ``what``."""
        kwargs: dict[str, str | None]
        if self.kind == "gguf":
            path = Path(self.location)
            location, kwargs = str(path.parent), {"gguf_file": path.name}
        else:
            location, kwargs = self.location, {"revision": self.revision}
        try:
            return from_pretrained(location, **kwargs)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot load {what} of {self.location}: {exc}") from exc


def resolve_model(spec: str, revision: str | None = None) -> ModelSource:
    path = Path(spec).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{spec!r} is a file but not a .gguf file")
        return ModelSource("gguf", str(path.resolve()))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"folder {spec!r} has no config.json")
        return ModelSource("folder", str(path.resolve()))
    if _REPO_ID.match(spec) and not spec.startswith((".", "/")):
        return ModelSource("hub", spec, revision)
    raise ModelLoadError(f"{spec!r} is neither a local folder, a .gguf file, nor a hub repo id")


def load_config(source: ModelSource, cache_dir: Path | None = None) -> PretrainedConfig:
    """The model's transformers config (reads only metadata: config.json, or the GGUF header).

    With ``cache_dir``, a GGUF file's config comes from there once transformers has converted it (its conversion
    parses the whole file, vocabulary included: seconds; ``shared.config_cache``).
    """

    def convert() -> PretrainedConfig:
        config: PretrainedConfig = source.load(AutoConfig.from_pretrained, "the config")
        return config

    if source.kind == "gguf" and cache_dir is not None:
        from shared.config_cache import cached_config

        return cached_config(Path(source.location), cache_dir, convert)
    return convert()
