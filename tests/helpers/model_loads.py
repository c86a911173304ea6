"""Which of a model's parts (``ModelSource.load``'s ``what``: "the tokenizer", "the draft model", ...) a test's code
loads from the model's files, in order, rather than reading them back from a cache."""

from __future__ import annotations

from typing import Any

import pytest

from shared.model_source import ModelSource


def record_model_loads(monkeypatch: pytest.MonkeyPatch, stand_ins: dict[str, Any] | None = None) -> list[str]:
    """The list each load's ``what`` is appended to. A load named in ``stand_ins`` returns that object instead of
    reading the files (a tiny model where the test does not read the weights)."""
    loads: list[str] = []
    real_load = ModelSource.load

    def recording_load(self: ModelSource, from_pretrained: Any, what: str) -> Any:
        loads.append(what)
        if stand_ins is not None and what in stand_ins:
            return stand_ins[what]
        return real_load(self, from_pretrained, what)

    monkeypatch.setattr(ModelSource, "load", recording_load)
    return loads
