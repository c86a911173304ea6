"""Settings of `swarm_node dht` and `swarm_node serve`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import Field, field_validator

from shared.lora import AdapterSpecs, parse_adapter_specs
from shared.settings import P2PSettings, positional

if TYPE_CHECKING:
    from swarm_node.decode_batcher import BatchPolicy
    from swarm_node.fair_share import ShareLimits

# --faulty-outputs (testing only): what each mode does is in swarm_node/faults.py.
FaultyOutputs = Literal[
    "none",
    "nan",
    "shape",
    "dtype",
    "noise",
    "stale-cache",
    "wrong-weights",
    "low-precision",
    "lazy",
    "bad-receipt",
    "forward-shape",
    "forward-noise",
]


class DhtSettings(P2PSettings):
    """Run a bootstrap DHT peer; prints the multiaddrs others join with, one per line, then runs until stopped."""

    relay_hop: bool = Field(
        True,
        description="relay connections for nodes that cannot be dialled (behind NAT), within the --relay-max-* limits",
    )


class NodeSettings(P2PSettings):
    """Host a span of a model's transformer blocks and serve it to the swarm."""

    model: str = positional("a local Hugging Face folder, a .gguf file, or a hub repo id")
    blocks: str | None = Field(None, description="the span to serve, as START:END (half-open)")
    num_blocks: int | None = Field(None, gt=0, description="serve this many blocks where the swarm needs them")
    revision: str | None = Field(None, description="hub revision (branch, tag or commit) when MODEL is a repo id")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="where the span runs; auto: cuda if present")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="compute dtype; auto: bfloat16 on cuda, float32 on cpu"
    )
    quant: Literal["auto", "none", "int8", "nf4"] = Field(
        "auto",
        description="weight quantization of the span's projections (bitsandbytes LLM.int8 or 4-bit NF4); auto: nf4 on"
        " cuda (a quarter of bfloat16's memory), none on cpu (exact outputs; RAM rarely limits a cpu node)",
    )
    cache_tokens: int | None = Field(
        None,
        gt=0,
        description="KV-cache pool size, in tokens across all sessions; default: on cuda, 90% of the GPU memory"
        " free after the weights; on cpu, 16384 or what fits in a quarter of the available RAM, whichever is less",
    )
    session_idle_timeout: float = Field(
        300.0, gt=0, description="seconds a session may go without a step before it is closed and its room freed"
    )
    batch_window: float = Field(
        0.1,
        ge=0,
        le=1,
        description="most seconds a decode batch waits for steps of other sessions due to arrive (judged by each"
        " session's rhythm); it waits at most about one forward's duration, and a lone session never waits",
    )
    max_batch_size: int = Field(32, gt=0, description="most sessions' decode steps in one batched forward")
    peer_cache_share: float = Field(
        0.5,
        gt=0,
        le=1,
        description="fair share: the fraction of the KV-cache pool one peer (a gateway, by its peer id) may hold while"
        " another peer has sessions or steps here or waits for room; over it, its new sessions and"
        " growth are refused with the retryable cache_full (a peer alone may use the whole pool)",
    )
    peer_max_sessions: int = Field(
        128, gt=0, description="fair share: open sessions one peer may hold while other peers use this node"
    )
    peer_max_queued_steps: int = Field(
        64, gt=0, description="fair share: steps of one peer queued or running at once while other peers use this node"
    )
    cpu_batched_copy: Literal["auto", "on", "off"] = Field(
        "auto",
        description="float32 on the CPU, --quant none: also keep a oneDNN-packed copy of the projections for forwards"
        " of 2+ rows (about twice as fast as MKL for batched decode on AVX-512 CPUs; doubles the projections'"
        " memory); auto: only where a probe at load shows it takes at most 0.8 of MKL's time",
    )
    prefill_chunk_tokens: int = Field(
        512,
        gt=0,
        description="padded prompt tokens per prefill forward (prompts queued together share one; longer prompts are"
        " split): bounds activation memory",
    )
    max_session_length: int | None = Field(
        None, gt=0, description="longest session accepted; default: the model's context length"
    )
    num_threads: int | None = Field(
        None,
        gt=0,
        description="torch CPU threads; default: torch's own choice (one per core). Processes sharing cores should"
        " split them: OpenMP threads of oversubscribed processes spin against each other (3 processes x 2 threads"
        " on 2 cores ran 10x slower than x 1)",
    )
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
    faulty_outputs: FaultyOutputs = Field(
        "none",
        description="testing only: a node that lies. Malformed (gateways ban it at once): nan, shape, dtype answer"
        " NaNs, a wrong shape or a wrong dtype. Healthy-looking (only comparing with replicas tells): noise adds 1%"
        " relative noise to every output, stale-cache never keeps keys/values, wrong-weights computes its first block"
        " with weights of another seed, low-precision announces --quant but computes nf4, lazy answers its input."
        " bad-receipt computes right but signs its receipts with a key its certificate does not name."
        " forward-shape serves sessions right but answers stateless forwards (what a gateway asks a reference"
        " replica during another node's check) with a wrong shape; forward-noise the same with noise's values."
        " The self-test refuses stale-cache (see --skip-self-test)",
    )
    skip_self_test: bool = Field(
        False,
        description="testing only: announce the span without its known-answer self-test (a prefill against prefill plus"
        " a decode step; each quantized block against its float weights), so tests can start nodes the self-test would"
        " refuse (--faulty-outputs stale-cache) and check that gateways catch them",
    )
    throughput_cache: str = Field(
        "~/.cache/swarmgate/throughput.json",
        description="file caching measured speed per (model, device, dtype, quant); delete it to measure again",
    )
    config_cache: str = Field(
        "~/.cache/swarmgate/configs",
        description="folder keeping each GGUF file's transformers config once converted (per file and transformers"
        " version), so nodes on a machine convert a file's config once, not at every start",
    )
    metrics_port: int | None = Field(
        None, ge=0, le=65535, description="serve Prometheus metrics (swarmgate_node_*) on this port; default: off"
    )
    relay_hop: bool = Field(
        True,
        description="once this node is found reachable directly: relay connections for nodes that are not (behind"
        " NAT), within the --relay-max-* limits",
    )
    relay_wait: float = Field(
        300.0,
        gt=0,
        description="with --use-relay: seconds to wait until a relay dials this node back through its slot (the"
        " node reserves one itself at once; p2pd's autorelay, the fallback, about 3 minutes after start) before"
        " announcing unreachable",
    )
    use_relay: bool = Field(
        True,
        description="when no peer can dial this node (behind NAT or a firewall), reserve a slot on a relay (the"
        " initial peers) and be reached through it; off: such a node is announced unreachable and gets no traffic",
    )
    adapters: AdapterSpecs = Field(
        default_factory=list,
        description="PEFT LoRA adapters to serve beside the base model, as NAME=PATH (a folder with"
        " adapter_config.json and adapter_model.safetensors); only the span's blocks' tensors are loaded, and NAME"
        " is announced: a gateway serves NAME as a model of its own (it needs the same NAME=PATH)",
    )
    metrics_host: str = Field(
        "127.0.0.1", description="address the metrics port binds; 0.0.0.0 lets a Prometheus on another host scrape"
    )

    @field_validator("blocks")
    @classmethod
    def _check_blocks(cls, value: str | None) -> str | None:
        if value is not None:
            parse_blocks(value)
        return value

    def adapter_folders(self) -> dict[str, Path]:
        return parse_adapter_specs(self.adapters)

    def span(self) -> tuple[int, int] | None:
        return parse_blocks(self.blocks) if self.blocks else None

    def share_limits(self) -> ShareLimits:
        from swarm_node.fair_share import ShareLimits

        return ShareLimits(self.peer_cache_share, self.peer_max_sessions, self.peer_max_queued_steps)

    def batch_policy(self) -> BatchPolicy:
        from swarm_node.decode_batcher import BatchPolicy  # torch-heavy; --help need not import it

        return BatchPolicy(self.batch_window, self.max_batch_size, self.prefill_chunk_tokens)


def parse_blocks(text: str) -> tuple[int, int]:
    try:
        start_text, end_text = text.split(":")
        start, end = int(start_text), int(end_text)
    except ValueError:
        raise ValueError(f"--blocks must look like START:END, got {text!r}") from None
    if not 0 <= start < end:
        raise ValueError(f"--blocks {text!r} is empty or negative")
    return start, end
