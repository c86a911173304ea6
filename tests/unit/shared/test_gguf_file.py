"""Our GGUF header reader against gguf-py's own, on the real SmolLM2 Q4_1 file, and its refusals of broken files.

The GGUF tests in test_loading.py then prove, per family, that tensors read through it equal transformers' load.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from transformers.modeling_gguf_pytorch_utils import read_field

from shared.errors import ModelLoadError
from shared.gguf_file import read_gguf


def test_metadata_and_tensors_equal_gguf_pys_reader(smollm2_gguf: Path) -> None:
    ours = read_gguf(smollm2_gguf)
    theirs = gguf.GGUFReader(smollm2_gguf)
    keys = [key for key in theirs.fields if not key.startswith("GGUF.")]
    assert set(ours.metadata) | set(ours.string_arrays) == set(keys)
    assert set(ours.string_arrays) == {"tokenizer.ggml.tokens", "tokenizer.ggml.merges"}
    for key in keys:
        values = read_field(theirs, key)
        if key in ours.string_arrays:
            assert ours.string_arrays[key] == len(values), key
        elif theirs.fields[key].types[0] == gguf.GGUFValueType.ARRAY:
            assert list(ours.metadata[key]) == values, key  # type: ignore[arg-type]
        else:
            assert ours.metadata[key] == pytest.approx(values[0]), key
    assert set(ours.tensors) == {tensor.name for tensor in theirs.tensors}
    for tensor in theirs.tensors:
        mine = ours.tensors[tensor.name]
        assert mine.kind == tensor.tensor_type
        assert mine.shape == tuple(int(d) for d in reversed(tensor.shape))
        assert np.array_equal(mine.data.reshape(-1).view(np.uint8), tensor.data.reshape(-1).view(np.uint8))


def test_a_truncated_file_is_a_load_error(smollm2_gguf: Path, tmp_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(smollm2_gguf.read_bytes()[: 50 * 2**20])  # the header whole, the tensors' data cut short
    with pytest.raises(ModelLoadError, match="past the end of the file"):
        read_gguf(cut)
    header = tmp_path / "header.gguf"
    header.write_bytes(smollm2_gguf.read_bytes()[:4096])  # cut inside the vocabulary
    with pytest.raises(ModelLoadError, match="cannot read the GGUF file"):
        read_gguf(header)


def test_a_file_that_is_not_gguf_is_a_load_error(tmp_path: Path) -> None:
    other = tmp_path / "model.gguf"
    other.write_bytes(b"PK\x03\x04" + bytes(64))
    with pytest.raises(ModelLoadError, match="no GGUF magic"):
        read_gguf(other)
