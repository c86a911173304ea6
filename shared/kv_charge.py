"""What a session's cache costs a node's pool: the pool counts tokens of the whole span, a session's keys and values
are allocated for its own blocks only.

A node's ``CachePool`` is sized in tokens of its whole span (``swarm_node.capacity.default_cache_tokens``: the free
memory over the KV bytes of one token on every block of the span), while ``swarm_node.kv_cache.SessionKV`` allocates
``[blocks, heads, max_length, dim]`` for the blocks the session asked for. A session over ``blocks`` of a
``span``-block node so holds ``max_length x blocks / span`` of the pool's tokens. Charging it ``max_length`` (the
whole span's worth) refused sessions the memory had room for: the simulator found 45 % of a busy 70B swarm's hops
entering or leaving a node mid-span, and the pools charging 0.90 of the swarm's KV memory while sessions used 0.78.

Routing (``gateway.swarm.routing``) still reads a node as short of room when it has less than a session's whole
``max_length``: reading a hop's share there too was tried in the simulator and gave fewer tokens/s (routes took more,
slower hops through scattered room; ``bench/README.md``).
"""

from __future__ import annotations


def pool_tokens(max_length: int, blocks: int, span: int) -> int:
    """Tokens of a ``span``-block pool that a session of ``max_length`` tokens over ``blocks`` of its blocks holds
    (rounded up: the pool never lends more memory than it has)."""
    if not 0 < blocks <= span:
        raise ValueError(f"a session uses 1 to {span} blocks of this span, not {blocks}")
    return -(-max_length * blocks // span)
