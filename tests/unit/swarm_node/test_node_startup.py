"""A volunteer's first start: blocks chosen from memory, flag mistakes as one argparse error line, and the node's
HTTP probes (liveness, and readiness only once the span is loaded and announced)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from shared.dht_records import NodeState
from swarm_node import cli
from swarm_node.block_count import MARGIN_BYTES, NotEnoughMemory, auto_num_blocks
from swarm_node.capacity import block_weight_bytes
from swarm_node.metrics import NodeGauges, NodeMetrics
from swarm_node.span import kv_bytes_per_token
from tests.tiny_models import NUM_LAYERS, GetTinyModel

CPU = torch.device("cpu")


def test_auto_block_count_is_what_the_memory_budget_holds(tiny_model: GetTinyModel) -> None:
    config = tiny_model("llama").model.config
    per_block = block_weight_bytes(config, torch.float32, "none") + kv_bytes_per_token(config, 1, torch.float32) * 1000
    # CPU: half the available RAM, less the margin.
    for blocks in (1, 2, 5):
        free = 2 * (MARGIN_BYTES + blocks * per_block + per_block // 2)
        assert auto_num_blocks(config, CPU, torch.float32, "none", 1000, free_bytes=free) == blocks
    plenty = 10 * 2**40
    assert auto_num_blocks(config, CPU, torch.float32, "none", 1000, free_bytes=plenty) == NUM_LAYERS  # capped
    with pytest.raises(NotEnoughMemory, match="holds no block"):
        auto_num_blocks(config, CPU, torch.float32, "none", 1000, free_bytes=2 * MARGIN_BYTES)


def test_quantized_blocks_are_smaller_so_more_fit(tiny_model: GetTinyModel) -> None:
    config = tiny_model("llama").model.config
    free = 2 * MARGIN_BYTES + 6 * block_weight_bytes(config, torch.float32, "none")
    plain = auto_num_blocks(config, CPU, torch.float32, "none", 1, free_bytes=free)
    nf4 = auto_num_blocks(config, CPU, torch.float32, "nf4", 1, free_bytes=free)
    assert plain < nf4


def run_serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "swarm_node.cli", "serve", *args],
        capture_output=True,
        text=True,
        timeout=400,  # importing torch on a loaded 2-core machine
        env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(Path.cwd())},
    )


def serve_in_this_process(
    args: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> list[str]:
    """``swarm_node serve ARGS``'s ``main`` in this process, which must end it the argparse way (exit 2; anything
    else, a traceback, fails the test): the lines it wrote to stderr, usage first."""
    for name in [name for name in os.environ if name.startswith("SWARMGATE_")]:
        monkeypatch.delenv(name)  # as the real command's: flags only
    monkeypatch.setattr(cli, "configure_logging", lambda: None)  # the test process's logging is not the command's
    with pytest.raises(SystemExit) as exited:
        cli.main(["serve", *args])
    assert exited.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0].startswith("usage: swarm_node serve")
    return lines


def test_a_bad_flag_value_ends_the_real_command_with_one_argparse_error(tiny_model: GetTinyModel) -> None:
    """The process itself, once: usage, one error line, exit 2, no traceback. The cases below run the same ``main``
    in this process (a process each costs its imports, several seconds on this machine)."""
    done = run_serve(str(tiny_model("llama").folder), "--blocks", "3")
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines[0].startswith("usage: swarm_node serve")
    assert lines[-1] == "swarm_node serve: error: --blocks must look like START:END, got '3'", lines[-1]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["{model}", "--blocks", "3"], "--blocks must look like START:END"),
        (["{model}", "--blocks", "4:2"], "is empty or negative"),
        (["{model}", "--blocks", "0:99"], "beyond the model's 6 blocks"),
        (["{model}", "--num-blocks", "0"], "--num-blocks: Input should be greater than 0"),
        (["{model}", "--num-blocks", "7"], "exceeds the model's 6 blocks"),
        (["{model}", "--quant", "int4"], "argument --quant: invalid choice"),
        (["{model}", "--cache-tokens", "lots"], "argument --cache-tokens: invalid int value"),
        (["/nonexistent/model-folder"], "is neither a local folder"),
        (["{model}", "--initial-peers", "dht:31337"], "--initial-peers: Invalid MultiAddr"),
        (["{model}", "--swarm-secret", "short"], "the swarm secret must be at least 16 bytes long"),
    ],
)
def test_bad_flag_values_are_one_argparse_error_never_a_traceback(
    tiny_model: GetTinyModel,
    args: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    folder = str(tiny_model("llama").folder)
    lines = serve_in_this_process([arg.replace("{model}", folder) for arg in args], capsys, monkeypatch)
    assert lines[-1].startswith("swarm_node serve: error: ") and message in lines[-1], lines[-1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_asking_for_cuda_without_it_is_a_flag_error(
    tiny_model: GetTinyModel, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    args = [str(tiny_model("llama").folder), "--device", "cuda", "--blocks", "0:1"]
    lines = serve_in_this_process(args, capsys, monkeypatch)
    assert lines[-1].startswith("swarm_node serve: error: --device cuda: this machine")


def test_probes_say_alive_at_once_and_ready_only_when_told() -> None:
    state = {"ready": False}
    gauges = NodeGauges(
        cache_tokens_total=lambda: 100,
        cache_tokens_left=lambda: 100,
        sessions_open=lambda: 0,
        queue_depth=lambda: 0,
        state=lambda: NodeState.JOINING,
        span=lambda: (0, 3),
    )
    metrics = NodeMetrics(gauges)
    server = metrics.serve("127.0.0.1", 0, lambda: (state["ready"], "online" if state["ready"] else "joining"))
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{server.server_port}", trust_env=False, timeout=10) as http:
            assert http.get("/health").status_code == 200
            not_ready = http.get("/ready")
            assert not_ready.status_code == 503 and "joining" in not_ready.text
            state["ready"] = True
            assert http.get("/ready").status_code == 200
            assert "swarmgate_node_cache_capacity_tokens 100.0" in http.get("/metrics").text
    finally:
        server.shutdown()
        server.server_close()


def test_a_node_parses_its_gguf_file_once_for_the_load_and_the_self_test(
    smollm2_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The int8 self-test rebuilds each block in float from the checkpoint: from the reader the load opened."""
    from shared import gguf_file
    from swarm_node.server import SpanServer
    from swarm_node.settings import NodeSettings

    parsed: list[str] = []
    read_gguf = gguf_file.read_gguf
    monkeypatch.setattr(gguf_file, "read_gguf", lambda path: parsed.append(str(path)) or read_gguf(path))
    settings = NodeSettings(
        model=str(smollm2_gguf), blocks="0:2", quant="int8", device="cpu", throughput_cache=str(tmp_path / "t.json")
    )
    server = SpanServer(settings)

    async def load_and_test() -> None:
        backend = await server._load(0, 2)
        try:
            await server._self_test(backend)
        finally:
            backend.shutdown()

    asyncio.run(load_and_test())
    assert parsed == [str(smollm2_gguf)]
