"""What nodes and gateways keep between starts on one machine: a GGUF file's converted config (--config-cache)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from shared.config_cache import cache_key
from shared.model_source import load_config, resolve_model
from tests.helpers.gateway import spawn_gateway
from tests.helpers.processes import CONFIG_CACHE, LocalSwarm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_a_gateway_keeps_its_gguf_config_in_the_cache(
    local_swarm: LocalSwarm, smollm2_gguf: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "gateway-configs"
    local_swarm.start_dht()
    gateway = spawn_gateway(local_swarm, smollm2_gguf, "--config-cache", str(cache))  # its config comes first
    entry = cache / f"{cache_key(smollm2_gguf)}.json"
    deadline = time.monotonic() + 240
    while not entry.exists():
        assert time.monotonic() < deadline, f"no config cache entry {entry}:\n{gateway.log_text()[-3000:]}"
        assert gateway.popen.poll() is None, gateway.log_text()[-3000:]
        time.sleep(0.2)
    cached = load_config(resolve_model(str(smollm2_gguf)), cache)  # read back from the entry
    # transformers' conversion as every other test's processes made it (the suite's own cache, CONFIG_CACHE)
    assert cached.to_dict() == load_config(resolve_model(str(smollm2_gguf)), CONFIG_CACHE).to_dict()
