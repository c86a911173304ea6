"""Settings of the gateway's generation engine and of its commands (`gateway generate`, `gateway serve`)."""

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
    allowed_peers: list[str] = Field(
        default_factory=list, description="if given, route only through these node peer ids (an allowlist)"
    )
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


class ServeSettings(EngineSettings):
    """Serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, ...) for a model."""

    host: str = Field("127.0.0.1", description="address the HTTP server listens on (0.0.0.0: every interface)")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port (0: any free port, logged at start)")
    served_model_name: str | None = Field(
        None, description="the API's model id; default: the model folder's / repo's / GGUF file's base name"
    )
    redis_url: str | None = Field(None, description="Redis URL of the session store shared by gateway replicas")
    default_max_tokens: int = Field(
        1024,
        ge=0,
        description="max tokens of a chat completion that sets none (or a completion with max_tokens null); 0: the "
        "rest of the context window, OpenAI's default, costly since nodes reserve KV-cache room for all of it up front",
    )
