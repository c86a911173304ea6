"""The path LP bound: column generation with exact pricing equals the LP over every chain enumerated by hand, and
is never above the per-node relaxation (``flow_bound`` with each pool at its node's fastest chain)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.optimize import linprog

from sim import geography
from sim.fastest_chain import CITY_INDEX, Placement, chain_graph, fastest_rounds
from sim.flow_bound import Stage, max_throughput
from sim.route_plan.chains import CHUNK, Chain, Graph, _undominated, price
from sim.route_plan.path_lp import PathBound, fastest_plan, path_bound
from tests.unit.sim.test_fastest_chain import chains as hops

GATEWAYS = ((CITY_INDEX["Ashburn"], 0.0005), (CITY_INDEX["Singapore"], 0.0005))
WORK = 0.005


def round_by_hand(p: Placement, gateway: tuple[int, float], chain: list[tuple[int, int]]) -> float:
    """Seconds per token from ``geography.rtt`` directly: half of each link's round trip, the steps, the work."""
    cities = geography.CITIES
    here, cost = (cities[gateway[0]], gateway[1]), WORK
    for node, entry in chain:
        city, mile = cities[int(p.cities[node])], float(p.last_miles[node])
        cost += geography.rtt(here[0], city, here[1], mile) / 2
        cost += p.fixed[node] + (p.ends[node] - entry) * p.token_time[node]
        here = (city, mile)
    return cost + geography.rtt(here[0], cities[gateway[0]], here[1], gateway[1]) / 2


def lp_by_hand(p: Placement, blocks: int, capacity: np.ndarray, pool: np.ndarray, held: float) -> float:
    """The LP over every chain, written out."""
    spans = p.ends - p.starts
    columns = []
    for gateway in GATEWAYS:
        for chain in hops(p, 0, blocks):
            t = round_by_hand(p, gateway, chain)
            column = np.zeros(2 * len(spans))
            for node, entry in chain:
                used = p.ends[node] - entry
                column[node] = used
                column[len(spans) + node] = t * held * used / spans[node]
            columns.append(column)
    if not columns:
        return 0.0
    limits = np.concatenate([capacity * spans, pool])
    result = linprog(-np.ones(len(columns)), A_ub=np.array(columns).T, b_ub=limits, method="highs")
    return float(-result.fun)


def per_node(p: Placement, blocks: int, capacity: np.ndarray, pool: np.ndarray, held: float) -> float:
    rounds = fastest_rounds(p, [(geography.CITIES[c], m) for c, m in GATEWAYS], blocks) + WORK
    stages = [
        Stage(int(s), int(e), min(float(c), float(k) / held / float(r)))
        for s, e, c, k, r in zip(p.starts, p.ends, capacity, pool, rounds, strict=True)
    ]
    return max_throughput(stages, blocks)


def random_swarm(seed: int, nodes: int = 8, blocks: int = 6) -> tuple[Placement, int, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    blocks, count = int(rng.integers(3, blocks + 1)), int(rng.integers(3, nodes + 1))
    starts = rng.integers(0, blocks, count)
    placement = Placement(
        starts,
        np.array([rng.integers(s + 1, blocks + 1) for s in starts]),
        rng.integers(0, len(geography.CITIES), count),
        rng.uniform(0.0005, 0.01, count),
        rng.uniform(0.01, 0.05, count),
        rng.choice([0.0, 0.002], count),
    )
    return placement, blocks, rng.uniform(5.0, 50.0, count), rng.uniform(500.0, 5000.0, count)


@pytest.mark.parametrize("seed", range(40))
def test_column_generation_equals_the_lp_over_every_chain(seed: int) -> None:
    p, blocks, capacity, pool = random_swarm(seed)
    graph = chain_graph(p, GATEWAYS, blocks, WORK)
    found = path_bound(graph, capacity, pool, held_length=300.0)
    assert found is not None and found.closed
    expected = lp_by_hand(p, blocks, capacity, pool, 300.0)
    assert found.tokens_per_s == pytest.approx(expected, rel=1e-6, abs=1e-9)
    assert found.tokens_per_s <= per_node(p, blocks, capacity, pool, 300.0) * (1 + 1e-6) + 1e-9


@pytest.mark.parametrize("seed", range(60))
def test_pricing_finds_the_least_price_of_every_chain(seed: int) -> None:
    p, blocks, _, _ = random_swarm(seed, nodes=18, blocks=8)
    graph = chain_graph(p, GATEWAYS, blocks, WORK)
    rng = np.random.default_rng(1000 + seed)
    # Prices spread over orders of magnitude, so that no one of A, T and M decides alone which chain is least.
    a, m = rng.lognormal(-4, 2, len(p.starts)), rng.lognormal(-2, 2, len(p.starts))
    prices = []
    for g, gateway in enumerate(GATEWAYS):
        for chain in hops(p, 0, blocks):
            t = round_by_hand(p, gateway, chain)
            assert graph.round(Chain(g, tuple(chain))) == pytest.approx(t)
            used = [(n, p.ends[n] - e) for n, e in chain]
            prices.append(sum(a[n] * k for n, k in used) + t * sum(m[n] * k for n, k in used))
    if not prices:
        return
    least = min(prices)

    def priced(chain: Chain) -> float:
        used = graph.blocks_of(chain)
        return sum(a[n] * k for n, k in used) + graph.round(chain) * sum(m[n] * k for n, k in used)

    # Thresholds just above the least price (pruning bites) and far above it (dominance alone).
    for threshold in (least * (1 + 1e-9) + 1e-12, sorted(prices)[len(prices) // 2], 10 * max(prices)):
        found, chains = price(graph, a, m, threshold)
        assert found == pytest.approx(least, rel=1e-9)
        assert len(chains) == len({c for _, c in chains}) >= 1
        assert [f for f, _ in chains] == sorted(f for f, _ in chains)
        assert all(f == pytest.approx(priced(c), rel=1e-9) for f, c in chains)


def shared_fast_node() -> tuple[Placement, np.ndarray, np.ndarray, float, Graph]:
    """Blocks 0:1 on X, 1:2 on Y (beside X, a small pool) or Z (across the world, a huge one), one gateway beside X:
    (placement, capacity, pool, held length, graph)."""
    city, far = CITY_INDEX["Ashburn"], CITY_INDEX["Sydney"]
    p = Placement(
        np.array([0, 1, 1]), np.array([1, 2, 2]), np.array([city, city, far]),
        np.full(3, 0.0005), np.full(3, 0.02), np.zeros(3),
    )  # fmt: skip
    return p, np.full(3, 1e6), np.array([10_000.0, 1_000.0, 1e9]), 100.0, chain_graph(p, (GATEWAYS[0],), 2, WORK)


def solved(seed: int) -> tuple[Placement, int, np.ndarray, np.ndarray, Graph, PathBound]:
    """``random_swarm(seed)``, its graph and its path LP (H = 300)."""
    p, blocks, capacity, pool = random_swarm(seed)
    graph = chain_graph(p, GATEWAYS, blocks, WORK)
    found = path_bound(graph, capacity, pool, held_length=300.0)
    assert found is not None
    return p, blocks, capacity, pool, graph, found


def test_one_shared_fast_node_makes_it_strictly_tighter() -> None:
    # The per-node relaxation credits X's pool at the fast chain X-Y although Y's small pool carries few sessions
    # and the rest must go the slow way, X-Z.
    p, capacity, pool, held, graph = shared_fast_node()
    city = CITY_INDEX["Ashburn"]
    fast, slow = graph.round(Chain(0, ((0, 0), (1, 1)))), graph.round(Chain(0, ((0, 0), (2, 1))))
    assert slow > 2 * fast
    # Y's pool carries 1,000 / (100 x fast); X's remaining 9,000 go the slow way.
    expected = 1_000 / held / fast + 9_000 / held / slow
    found = path_bound(graph, capacity, pool, held)
    assert found is not None and found.tokens_per_s == pytest.approx(expected, rel=1e-6)
    rounds = fastest_rounds(p, [(geography.CITIES[city], 0.0005)], 2) + WORK
    stages = [
        Stage(s, e, min(1e6, k / held / r)) for s, e, k, r in zip((0, 1, 1), (1, 2, 2), pool, rounds, strict=True)
    ]
    relaxed = max_throughput(stages, 2)
    assert relaxed == pytest.approx(10_000 / held / fast, rel=1e-6)
    assert found.tokens_per_s < 0.6 * relaxed


def test_below_the_optimum_the_fastest_plan_takes_the_fast_chain_only() -> None:
    # The optimum runs the fast chain X-Y to Y's pool and the rest the slow way, X-Z. A plan for less than Y's pool
    # carries runs X-Y alone; for more, X-Y full and the rest on X-Z; past the optimum, the optimum, the rest unmet.
    # The fast chain is found even when not among the chains given.
    _, capacity, pool, held, graph = shared_fast_node()
    fast, slow = Chain(0, ((0, 0), (1, 1))), Chain(0, ((0, 0), (2, 1)))
    on_y = 1_000 / held / graph.round(fast)  # what Y's pool carries

    def plan(demand: float) -> dict[Chain, float]:
        return dict(zip(*fastest_plan(graph, capacity, pool, held, (slow,), np.array([demand])), strict=True))

    assert plan(0.5 * on_y) == {fast: pytest.approx(0.5 * on_y)}
    assert plan(2 * on_y) == {fast: pytest.approx(on_y), slow: pytest.approx(on_y)}
    optimum = path_bound(graph, capacity, pool, held)
    assert optimum is not None
    assert sum(plan(10 * optimum.tokens_per_s).values()) == pytest.approx(optimum.tokens_per_s)


@pytest.mark.parametrize("seed", range(20))
def test_the_fastest_plan_carries_each_gateways_demand_within_every_row_with_no_more_sessions(seed: int) -> None:
    # The optimum scaled down carries the same demand at each gateway: the fastest plan carries it, on that
    # gateway's chains, holds no more sessions at once (sum of y x T) and fits every node's compute and KV room.
    p, _, capacity, pool, graph, optimum = solved(seed)
    demand = np.zeros(len(GATEWAYS))
    for chain, y in zip(optimum.used, optimum.rates, strict=True):
        demand[chain.gateway] += 0.4 * y
    chains, rates = fastest_plan(graph, capacity, pool, 300.0, optimum.known, demand)
    carried = np.zeros(len(GATEWAYS))
    for chain, y in zip(chains, rates, strict=True):
        carried[chain.gateway] += y
    assert carried == pytest.approx(demand, rel=1e-6, abs=1e-9)
    sessions = sum(y * graph.round(c) for c, y in zip(chains, rates, strict=True))
    scaled = sum(0.4 * y * graph.round(c) for c, y in zip(optimum.used, optimum.rates, strict=True))
    assert sessions <= scaled * (1 + 1e-6) + 1e-12
    spans = p.ends - p.starts
    compute, kv = np.zeros(len(spans)), np.zeros(len(spans))
    for chain, y in zip(chains, rates, strict=True):
        for node, used in graph.blocks_of(chain):
            compute[node] += y * used
            kv[node] += y * graph.round(chain) * 300.0 * used / spans[node]
    assert np.all(compute <= capacity * spans * (1 + 1e-6)) and np.all(kv <= pool * (1 + 1e-6))


def test_pricing_keeps_a_dearer_label_that_is_faster() -> None:
    # Block 0 on X (Ashburn, compute dear) or W (Sydney, free), block 1 on V (free), block 2 on Y (KV dear). At V the
    # label via W is cheaper so far and no heavier in M, but slower: Y's KV price, paid per second of the round,
    # makes the chain via X the cheaper one. A dominance rule that ignored T would keep W's label alone.
    near, far = CITY_INDEX["Ashburn"], CITY_INDEX["Sydney"]
    p = Placement(
        np.array([0, 0, 1, 2]), np.array([1, 1, 2, 3]), np.array([near, far, near, near]),
        np.full(4, 0.0005), np.full(4, 0.02), np.zeros(4),
    )  # fmt: skip
    graph = chain_graph(p, (GATEWAYS[0],), 3, WORK)
    a, m = np.array([0.1, 0.0, 0.0, 0.0]), np.array([0.0, 0.0, 0.0, 10.0])
    via_x, via_w = Chain(0, ((0, 0), (2, 1), (3, 2))), Chain(0, ((1, 0), (2, 1), (3, 2)))
    assert 0.1 + graph.round(via_x) * 10 < graph.round(via_w) * 10
    least, chains = price(graph, a, m, threshold=100.0)
    assert least == pytest.approx(0.1 + graph.round(via_x) * 10)
    assert chains[0][1] == via_x


@pytest.mark.parametrize("seed", range(10))
def test_starting_from_an_earlier_calls_chains_gives_the_same_bound(seed: int) -> None:
    p, blocks, capacity, pool, graph, cold = solved(seed)
    stale = Chain(0, ((len(p.starts), 0),))  # a node gone since: left out
    warm = path_bound(graph, capacity * 1.1, pool, held_length=300.0, start=(*cold.used, stale))
    assert warm is not None and warm.closed
    assert warm.tokens_per_s == pytest.approx(lp_by_hand(p, blocks, capacity * 1.1, pool, 300.0), rel=1e-6, abs=1e-9)


def test_every_chain_given_to_start_from_is_in_the_first_restricted_lp(monkeypatch: pytest.MonkeyPatch) -> None:
    # The chains sessions decode on are given as a start (``sim.dataflow.path``): thousands at 1,000 nodes. The
    # first round took only as many as were given, the fastest chains first, and cut the rest.
    monkeypatch.setattr("sim.route_plan.path_lp.PER_ROUND", 2)
    p, blocks, capacity, pool = random_swarm(10, nodes=10, blocks=6)
    graph = chain_graph(p, GATEWAYS, blocks, WORK)
    given = tuple(Chain(g, tuple(chain)) for g in range(len(GATEWAYS)) for chain in hops(p, 0, blocks))
    assert len(given) > 4
    found = path_bound(graph, capacity, pool, held_length=300.0, iterations=1, start=given)
    assert found is not None and set(given) <= set(found.known)


@pytest.mark.parametrize("seed", range(10))
def test_smoothed_duals_change_the_columns_not_the_bound(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # The cheap rounds price at smoothed duals (``SMOOTH``); the bound comes from exact pricing at the restricted
    # LP's own duals either way, so it is the LP's optimum with or without smoothing.
    p, blocks, capacity, pool = random_swarm(seed, nodes=14, blocks=8)
    graph = chain_graph(p, GATEWAYS, blocks, WORK)
    smoothed = path_bound(graph, capacity, pool, held_length=300.0)
    monkeypatch.setattr("sim.route_plan.path_lp.SMOOTH", 0.0)
    raw = path_bound(graph, capacity, pool, held_length=300.0)
    assert smoothed is not None and raw is not None and smoothed.closed and raw.closed
    assert smoothed.tokens_per_s == pytest.approx(raw.tokens_per_s, rel=1e-6, abs=1e-9)
    assert smoothed.tokens_per_s == pytest.approx(lp_by_hand(p, blocks, capacity, pool, 300.0), rel=1e-6, abs=1e-9)


@pytest.mark.parametrize("size", [1, 7, CHUNK, CHUNK + 1, 3 * CHUNK + 5])
def test_the_dominance_filter_keeps_exactly_the_labels_none_is_as_good_as(size: int) -> None:
    """Against every pair compared by hand, with ties (few distinct values): a label is dropped when another is no
    worse in f, t and m and either better in one or equal and earlier; across the filter's blocks too."""
    rng = np.random.default_rng(size)
    f, t, m = (rng.integers(0, 6, size).astype(np.float64) for _ in range(3))

    def dominated(j: int) -> bool:
        for i in range(size):
            no_worse = f[i] <= f[j] and t[i] <= t[j] and m[i] <= m[j]
            equal = f[i] == f[j] and t[i] == t[j] and m[i] == m[j]
            if i != j and no_worse and (not equal or i < j):
                return True
        return False

    assert _undominated(f, t, m).tolist() == [j for j in range(size) if not dominated(j)]
