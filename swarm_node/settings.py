"""Settings of `swarm_node dht` and `swarm_node serve`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from shared.settings import P2PSettings, positional


class DhtSettings(P2PSettings):
    """Run a bootstrap DHT peer; prints the multiaddrs others join with, one per line, then runs until stopped."""


class ServeSettings(P2PSettings):
    """Host a span of a model's transformer blocks and serve it to the swarm."""

    model: str = positional("a local Hugging Face folder, a .gguf file, or a hub repo id")
    blocks: str | None = Field(None, description="the span to serve, as START:END (half-open)")
    num_blocks: int | None = Field(None, gt=0, description="serve this many blocks where the swarm needs them")
    revision: str | None = Field(None, description="hub revision (branch, tag or commit) when MODEL is a repo id")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="where the span runs; auto: cuda if present")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="compute dtype; auto: bfloat16 on cuda, float32 on cpu"
    )
    quant: Literal["none"] = Field("none", description="weight quantization of the span's linear layers")
    cache_tokens: int = Field(16384, gt=0, description="KV-cache pool size, in tokens across all sessions")
    max_session_length: int | None = Field(
        None, gt=0, description="longest session accepted; default: the model's context length"
    )
    num_threads: int | None = Field(None, gt=0, description="torch CPU threads; default: torch's own choice")
    announce_period: float = Field(10.0, gt=0, description="seconds between DHT announcements")
    balance_period: float = Field(
        60.0, gt=0, description="with --num-blocks: seconds between checks whether moving would help the swarm"
    )
    balance_quality: float = Field(
        0.75, gt=0, le=1, description="move only if the swarm's minimum throughput would grow by more than 1/this"
    )
    drain_timeout: float = Field(
        60.0, ge=0, description="on stop or move: seconds to let open sessions finish before leaving"
    )
    added_latency: float = Field(
        0.0, ge=0, le=10, description="seconds added before every reply, to emulate a distant node (testing)"
    )
    throughput_cache: str = Field(
        "~/.cache/swarmgate/throughput.json",
        description="file caching measured speed per (model, device, dtype, quant); delete it to measure again",
    )

    @field_validator("blocks")
    @classmethod
    def _check_blocks(cls, value: str | None) -> str | None:
        if value is not None:
            parse_blocks(value)
        return value

    def span(self) -> tuple[int, int] | None:
        return parse_blocks(self.blocks) if self.blocks else None


def parse_blocks(text: str) -> tuple[int, int]:
    try:
        start_text, end_text = text.split(":")
        start, end = int(start_text), int(end_text)
    except ValueError:
        raise ValueError(f"--blocks must look like START:END, got {text!r}") from None
    if not 0 <= start < end:
        raise ValueError(f"--blocks {text!r} is empty or negative")
    return start, end
