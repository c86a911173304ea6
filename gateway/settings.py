"""Settings of the gateway's generation engine and of its commands (`gateway generate`, `gateway serve`)."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Literal, Self

from pydantic import Field, SecretStr, model_validator

from gateway.swarm.recovery import DEFAULT_FAILOVER_WAIT
from shared.lora import AdapterSpecs, parse_adapter_specs
from shared.settings import P2PSettings, ProcessSettings, positional


class EngineSettings(P2PSettings):
    """Generate text with a model whose blocks are served by the swarm."""

    model: str = positional("a local Hugging Face folder, a .gguf file, or a hub repo id (the nodes' MODEL)")
    revision: str | None = Field(None, description="hub revision when MODEL is a repo id")
    step_timeout: float = Field(
        30.0,
        gt=0,
        description="seconds one remote step may take on a node that still answers pings (a dead or frozen node is"
        " noticed within seconds by pinging it while a reply is overdue)",
    )
    failover_wait: float = Field(
        DEFAULT_FAILOVER_WAIT,
        ge=0,
        description="seconds a session that lost a node waits for another to serve its blocks (one joining, one"
        " coming back) or for room on a full one, before it fails with missing_blocks",
    )
    swarm_refresh: float = Field(2.0, gt=0, description="seconds a DHT view of the swarm stays fresh")
    verify: bool = Field(
        True,
        description="check nodes' arithmetic (docs/verification.md): a new node carries no user traffic until it"
        " passes a challenge against a replica of its blocks, and sampled served steps are re-run on another"
        " replica in the background",
    )
    verify_check_rate: float = Field(
        0.02,
        ge=0,
        description="extra compute spent on spot checks, as a fraction of the compute served (a step is re-run with"
        " its whole prefix, so it is picked in proportion to its tokens over that; nodes of low reputation 4x as"
        " often; 0: no spot checks, probation only)",
    )
    verify_threshold: float = Field(
        0.3, ge=0, le=1, description="reputation (0..1, new nodes 0.5) below which a node is out of routing"
    )
    verify_max_checks: int = Field(
        2, gt=0, description="spot checks running at once (a step sampled while they all run is not checked)"
    )
    num_threads: int | None = Field(None, gt=0, description="torch CPU threads; default: torch's own choice")
    config_cache: str = Field(
        "~/.cache/swarmgate/configs",
        description="folder keeping each GGUF file's transformers config and tokenizer once converted (per file and"
        " transformers version; the nodes' --config-cache), so a restart does not convert them again",
    )
    allowed_peers: list[str] = Field(
        default_factory=list, description="if given, route only through these node peer ids (an allowlist)"
    )
    push: bool = Field(
        True,
        description="decode steps go node to node (gateway → A → B → gateway) rather than back through the gateway",
    )
    push_min_rtt: float = Field(
        0.005,
        ge=0,
        description="push only when a later node of the chain is at least this far (round trip, seconds) from the"
        " gateway: at home the node-to-node messages cost more than the half round trip they save",
    )
    speculative: Literal["off", "ngram", "draft"] = Field(
        "ngram",
        description="speculative decoding: off; ngram (drafts from suffix matches over the prompt, the output and"
        " recent outputs, and a grammar's forced tokens); draft (drafts from --draft-model);"
        " k drafts are verified in one step of k+1 positions, k adaptive (from the acceptance rate and the chain's"
        " round trip; none below --speculative-min-rtt)",
    )
    embedding_pooling: Literal["auto", "last", "mean"] = Field(
        "auto",
        description="how /v1/embeddings pools the normed final hidden states: last (token), mean; auto: last, right"
        " for the causal models the swarm serves (docs/embeddings.md)",
    )
    draft_model: str | None = Field(
        None,
        description="with --speculative draft: a small model with the served model's tokenizer (a folder, .gguf"
        " file or hub id), loaded whole at the gateway",
    )
    speculative_max_k: int = Field(8, ge=1, le=32, description="most draft tokens verified in one step")
    speculative_trees: bool = Field(
        False,
        description="drafts may branch: several continuations verified in one step (nodes attend each to its own"
        " branch, and keep the accepted one), as many as the cost model finds worth their positions; off (the"
        " default: trees measured no more tokens per traversal than chains, and tree steps are not spot-checked):"
        " chains",
    )
    speculative_pipeline: Literal["off", "auto", "always"] = Field(
        "auto",
        description="pipelined verification: auto sends the next verify frame before the previous one returns,"
        " drafted as if that one were kept whole (a rejection voids it), where measured acceptance is above the cost"
        " model's break-even; always does so whenever a round drafts (for measuring); off never. Frames are relayed"
        " hop by hop on each node's own stream, and only a generation decoding alone pipelines",
    )
    speculative_min_rtt: float = Field(
        0.01,
        ge=0,
        description="draft only when the chain's round trips add up to at least this (seconds): on loopback the"
        " extra positions cost more than the round trips they save; a generation that drafts stops only below 0.7 of"
        " it (hysteresis: a probed round trip jittering around it does not switch drafting every round)",
    )
    routing: Literal["min_latency", "max_throughput"] = Field(
        "min_latency", description="default route choice: lowest latency, or spread sessions for throughput"
    )
    conversation_keep_alive: float = Field(
        60.0,
        ge=0,
        description="seconds a finished chat keeps its node sessions (shrunk to the tokens they hold) so that its next"
        " turn, from the same API key, prefills only its new tokens; 0: never kept",
    )
    conversation_max_kept: int = Field(
        8, ge=0, description="most chats kept at once by this gateway; beyond it the least recently used is closed"
    )
    chat_template: Path | None = Field(
        None, description="a Jinja chat template file used instead of the tokenizer's own (as vLLM's --chat-template)"
    )
    adapters: AdapterSpecs = Field(
        default_factory=list,
        description="PEFT LoRA adapters the nodes serve, as NAME=PATH (the nodes' NAME): each is a model of the API"
        " (parent: the base model) while some node serves it for every block; the gateway loads its embedding and"
        " LM-head parts from PATH",
    )

    def adapter_folders(self) -> dict[str, Path]:
        return parse_adapter_specs(self.adapters)

    def config_cache_folder(self) -> Path:
        return Path(self.config_cache).expanduser()

    max_model_len: int | None = Field(
        None,
        gt=0,
        description="longest prompt + completion in tokens; longer requests get 400 context_length_exceeded;"
        " default: the smaller of the model's max_position_embeddings and the longest session the swarm's nodes"
        " can hold (their KV-cache pools, as they announce them); a value over the model's is refused at start",
    )

    @model_validator(mode="after")
    def _check_draft(self) -> Self:
        if (self.speculative == "draft") != (self.draft_model is not None):
            raise ValueError("--speculative draft and --draft-model go together: give both or neither")
        return self


class GenerateSettings(EngineSettings):
    """Generate one completion from the command line (the HTTP API is `gateway serve`)."""

    prompt: str = Field(..., description="the prompt text")
    max_new_tokens: int = Field(32, gt=0, description="tokens to generate")
    temperature: float = Field(0.0, ge=0, description="0 is greedy")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling mass")
    seed: int | None = Field(None, description="sampling seed")


class RedisSettings(ProcessSettings):
    redis_url: str | None = Field(
        "redis://127.0.0.1:6379/0",
        description="Redis of the session store, API keys and quotas, shared by gateway replicas; while it is down"
        " the gateway serves from memory and writes through when it is back; empty: memory only (one replica)",
    )


class KeyCreateSettings(RedisSettings):
    """Create an API key; prints it once (only its hash is stored)."""

    name: str = positional("a name for the key (who or what uses it)")
    admin: bool = Field(False, description="the key sees and cancels every session, not only its own")
    requests_per_minute: int | None = Field(None, gt=0, description="requests per minute (none: unlimited)")
    tokens_per_minute: int | None = Field(
        None, gt=0, description="prompt + completion tokens per minute (a request reserves its max_tokens)"
    )
    concurrent_streams: int | None = Field(None, gt=0, description="generations running at once (none: unlimited)")


class KeyListSettings(RedisSettings):
    """List API keys (ids, names, limits; never the keys themselves)."""


class KeyRevokeSettings(RedisSettings):
    """Revoke an API key: it is refused from now on."""

    key_id: str = positional("the key's id (as `gateway keys list` shows it)")


class GatewaySettings(EngineSettings, RedisSettings):
    """Serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, ...) for a model."""

    host: str = Field("127.0.0.1", description="address the HTTP server listens on (0.0.0.0: every interface)")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port (0: any free port, logged at start)")
    served_model_name: str | None = Field(
        None, description="the API's model id; default: the model folder's / repo's / GGUF file's base name"
    )
    replica_id: str | None = Field(None, description="this replica's name in session records; default: host:pid")
    replicas: int = Field(
        1, ge=1, description="gateway replicas sharing Redis: while Redis is down each enforces 1/replicas of a quota"
    )
    auth: Literal["keys", "none"] | None = Field(
        None,
        description="keys: every /v1 request needs a valid API key; none: open, every caller is the admin. Default:"
        " keys when --host is beyond loopback or an operator key is given, none on loopback (the local demo)."
        " Never changes at run time: an empty or unreachable Redis refuses keys, it never opens the gateway",
    )
    admin_key: SecretStr | None = Field(
        None, description="an operator (admin, unlimited) API key, valid without Redis (e.g. a fresh cluster's first)"
    )
    admin_key_file: str | None = Field(
        None, description="file holding an operator API key (a mounted Secret); valid without Redis like --admin-key"
    )
    api_keys: list[SecretStr] = Field(
        default_factory=list,
        description="more operator API keys, admins valid without Redis, besides those made by `gateway keys create`"
        " (env: a JSON list)",
    )
    require_api_key: bool = Field(False, description="the same as --auth keys (kept for older deployments)")
    drain_timeout: float = Field(
        30.0, ge=0, description="on SIGTERM: seconds running generations get to finish (new ones get 503 draining)"
    )
    max_concurrent_generations: int = Field(
        0, ge=0, description="generations this replica runs at once; more get 429 with Retry-After (0: no cap)"
    )
    max_request_bytes: int = Field(
        8 * 1024 * 1024, ge=0, description="largest request body; larger ones get 413 before parsing (0: no limit)"
    )
    session_ttl: float = Field(3600.0, gt=0, description="seconds a session's record and events are kept after it ends")
    resume_grace: float = Field(
        2.0,
        ge=0,
        description="seconds a stream keeps generating after its client disconnects, so the client can resume it"
        " (GET /v1/sessions/{id}/events with Last-Event-ID); a resumed reader keeps it going; 0: stop at once",
    )
    allowed_origins: list[str] = Field(
        default_factory=list,
        description="browser origins allowed to call the API (CORS), e.g. https://app.example.com or * (env: a JSON"
        " list); default none: no CORS headers",
    )
    responses_ttl: float = Field(
        86400.0, gt=0, description="seconds a stored /v1/responses response (store: true) is kept after it ends"
    )
    default_max_tokens: int = Field(
        1024,
        ge=0,
        description="max tokens of a chat completion that sets none (or a completion with max_tokens null); 0: the "
        "rest of the context window, OpenAI's default, costly since nodes reserve KV-cache room for all of it up front",
    )
    tool_call_parser: Literal["auto", "hermes", "llama3_json", "mistral"] = Field(
        "auto",
        description="how tool calls are written and parsed: hermes (<tool_call>{json}</tool_call>), llama3_json, "
        "mistral ([TOOL_CALLS][...]); auto: from the chat template (hermes when it has no tool support)",
    )
    reasoning_parser: Literal["auto", "none", "qwen3", "deepseek_r1"] = Field(
        "auto",
        description="split <think>...</think> into reasoning_content (qwen3, deepseek_r1: the same tags); auto: when "
        "the chat template knows </think>; none: never",
    )

    @model_validator(mode="after")
    def _check_auth(self) -> Self:
        operator_keys = self.operator_keys()  # an unreadable --admin-key-file fails here, at start
        if self.auth == "none" and (self.require_api_key or operator_keys):
            raise ValueError("--auth none contradicts the operator keys or --require-api-key given: drop one side")
        return self

    def operator_keys(self) -> list[str]:
        """Admin keys that need no Redis: --admin-key, --admin-key-file, --api-keys (read once, at start)."""
        keys = [key.get_secret_value() for key in self.api_keys]
        if self.admin_key is not None:
            keys.append(self.admin_key.get_secret_value())
        if self.admin_key_file:
            try:
                text = Path(self.admin_key_file).read_text(encoding="utf-8").strip()
            except OSError as exc:
                raise ValueError(f"cannot read --admin-key-file {self.admin_key_file}: {exc.strerror}") from None
            if not text:
                raise ValueError(f"--admin-key-file {self.admin_key_file} is empty")
            keys.append(text)
        return [key for key in keys if key]

    def auth_mode(self) -> Literal["keys", "none"]:
        if self.auth is not None:
            return self.auth
        if self.require_api_key or self.operator_keys() or not is_loopback(self.host):
            return "keys"
        return "none"


def is_loopback(host: str) -> bool:
    """Whether ``host`` only accepts connections from this machine (0.0.0.0 and names other than localhost don't)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
