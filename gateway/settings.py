"""Settings of the gateway's generation engine (and, later, its HTTP server)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from shared.settings import P2PSettings, positional


class EngineSettings(P2PSettings):
    """Generate text with a model whose blocks are served by the swarm."""

    model: str = positional("a local Hugging Face folder, a .gguf file, or a hub repo id (the nodes' MODEL)")
    revision: str | None = Field(None, description="hub revision when MODEL is a repo id")
    step_timeout: float = Field(30.0, gt=0, description="seconds one remote step may take before it fails")
    swarm_refresh: float = Field(2.0, gt=0, description="seconds a DHT view of the swarm stays fresh")
    num_threads: int | None = Field(None, gt=0, description="torch CPU threads; default: torch's own choice")
    routing: Literal["min_latency", "max_throughput"] = Field(
        "min_latency", description="default route choice: lowest latency, or spread sessions for throughput"
    )


class GenerateSettings(EngineSettings):
    """Generate one completion from the command line (the HTTP API is `gateway serve`)."""

    prompt: str = Field(..., description="the prompt text")
    max_new_tokens: int = Field(32, gt=0, description="tokens to generate")
    temperature: float = Field(0.0, ge=0, description="0 is greedy")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling mass")
    seed: int | None = Field(None, description="sampling seed")
