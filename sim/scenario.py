"""One scenario run: populate the swarm, start traffic, apply the scenario's event, tick the data plane, and
summarize our throughput against the bound."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from gateway.swarm.routing import RoutingMode
from sim import clients, geography, lifecycle
from sim.dataflow import TICK, bound, path, tick
from sim.hardware import LLAMA_405B, ModelShape, sample_hardware
from sim.swarm import BALANCE_PERIOD
from sim.workload import CRASH_SHARE, Arrivals, mean_request, mean_uptime, sample_request, uptime
from sim.world import Metrics, SimGateway, World

JOIN_WINDOW = 60.0  # the initial nodes start over this many seconds
BOUND_EVERY = 15.0  # seconds between recomputations of the bound
# The path LP is also computed this long after an event: recovery is judged up to 2 balance periods + 10 s on, and
# a flash crowd lasts 60 s.
AFTER_EVENT = 2 * BALANCE_PERIOD + BOUND_EVERY


@dataclass(frozen=True)
class Scenario:
    name: str
    model: ModelShape = LLAMA_405B
    nodes: int = 100
    seed: int = 1
    duration: float = 720.0
    traffic_from: float = 120.0  # arrivals start once the first nodes are online
    measure_from: float = 420.0  # the steady-state window starts here
    load: float = 0.8  # offered tokens/s, as a multiple of the bound when traffic starts (KV memory binds first)
    event: str | None = None  # "leave" (a share of nodes crash at once), "region" (one goes dark), "flash"
    event_at: float = 520.0
    leave_share: float = 0.2
    region: str = "eu"
    slow_share: float = 0.0  # nodes that compute 5x slower than their GPU would, and announce so
    churn: bool = True
    mode: RoutingMode = RoutingMode.MIN_LATENCY
    balancing: bool = True
    planned_routing: bool = False  # gateways route whole chains by their plans (``route_plan.view_plan``)

    def quick(self) -> Scenario:
        """A small, short version for tests."""
        return replace(self, nodes=min(self.nodes, 40), duration=480.0, traffic_from=120.0, measure_from=330.0,
                       event_at=360.0)  # fmt: skip


@dataclass
class Result:
    """What a run leaves for the report (plain data: it crosses from a worker process)."""

    scenario: Scenario
    metrics: Metrics
    route_times: list[float]  # seconds each plan_route call took
    spans: list[int]  # blocks per node, every node that ever joined
    summary: dict[str, float] = field(default_factory=dict)


def settle(scenario: Scenario, until: float) -> World:
    """The scenario's nodes joined and placed (no traffic), at ``until`` seconds."""
    world = _populate(scenario)
    world.clock.run_until(until)
    return world


def _populate(scenario: Scenario) -> World:
    world = World(scenario.model, scenario.seed, scenario.mode)
    world.balancing = scenario.balancing
    world.planned_routing = scenario.planned_routing
    for _ in range(scenario.nodes):
        _add_node(world, scenario, float(world.rng.uniform(0, JOIN_WINDOW)))
    if scenario.churn:
        _replacements(world, scenario)
    return world


def run(scenario: Scenario) -> Result:
    world = _populate(scenario)
    mean_output, held_length = mean_request()
    world.clock.at(scenario.traffic_from, lambda: _start_traffic(world, scenario, mean_output, held_length))
    if scenario.event is not None:
        world.clock.at(scenario.event_at, lambda: _event(world, scenario))
    latest, tighter = (0.0, 0.0), float("nan")
    path_end = scenario.event_at + AFTER_EVENT if scenario.event else scenario.duration
    t = TICK
    while t <= scenario.duration:
        world.clock.run_until(t)
        throughput = tick(world)
        recompute = not world.metrics.bound or t % BOUND_EVERY < TICK
        if recompute:
            latest = bound(world, held_length)
        # The path LP costs seconds of CPU a call: only where the summary reads it, the steady window and the
        # recovery after an event (each call starts from the last one's chains still on the placement).
        if scenario.measure_from <= t < path_end and (recompute or math.isnan(tighter)):
            found = path(world, held_length)
            world.metrics.path_kept_node += found is None
            world.metrics.path_open += found is not None and not found.closed
            tighter = latest[0] if found is None else min(found.tokens_per_s, latest[0])
        elif t >= path_end:
            tighter = float("nan")
        _record(world, t, throughput, latest)
        world.metrics.path_bound.append(tighter)
        t += TICK
    spans = [n.span for n in world.node_list]
    return Result(scenario, world.metrics, world.route_times, spans, summarize(world, scenario))


def _add_node(world: World, scenario: Scenario, at: float) -> None:
    hw = sample_hardware(world.rng, scenario.model)
    city = geography.sample_city(world.rng)
    slow = 5.0 if world.rng.random() < scenario.slow_share else 1.0
    node = world.new_node(hw, city, geography.sample_last_mile(world.rng, hw.gpu.datacenter), slow)
    world.clock.at(at, lambda: lifecycle.join(world, node))
    if scenario.churn:
        leaves = at + uptime(world.rng, hw.gpu.datacenter)
        crash = bool(world.rng.random() < CRASH_SHARE)
        world.clock.at(leaves, lambda: lifecycle.leave(world, node, crash))


def _replacements(world: World, scenario: Scenario) -> None:
    """New volunteers join as a Poisson stream at the rate the leavers go: the population stays about the same."""
    datacenter = np.mean([n.hw.gpu.datacenter for n in world.node_list])
    mean = datacenter * mean_uptime(True) + (1 - datacenter) * mean_uptime(False)
    rate = scenario.nodes / mean

    def next_join() -> None:
        _add_node(world, scenario, world.clock.now)
        world.clock.after(float(world.rng.exponential(1 / rate)), next_join)

    world.clock.after(JOIN_WINDOW + float(world.rng.exponential(1 / rate)), next_join)


def _start_traffic(world: World, scenario: Scenario, mean_output: float, held_length: float) -> None:
    held, _ = bound(world, held_length)
    if held <= 0:  # a block is not served yet: the swarm has no throughput to size the load by
        world.clock.after(10.0, lambda: _start_traffic(world, scenario, mean_output, held_length))
        return
    arrivals = Arrivals(world.rng, held * scenario.load / mean_output, scenario.duration)
    if scenario.event == "flash":
        arrivals.add_window(scenario.event_at, scenario.event_at + 60.0, 5.0)
    world.offered = lambda now: arrivals.rate * arrivals.factor(now) * mean_output

    def next_session() -> None:
        clients.arrive(world, _gateway_for(world), sample_request(world.rng))
        world.clock.after(arrivals.next_gap(world.clock.now), next_session)

    world.clock.after(arrivals.next_gap(world.clock.now), next_session)


def _gateway_for(world: World) -> SimGateway:
    """Users are where volunteers are (the cities' shares); each uses the gateway nearest to it."""
    return world.nearest_gateway(geography.sample_city(world.rng))


def _event(world: World, scenario: Scenario) -> None:
    serving = world.serving()
    if scenario.event == "leave":
        count = int(round(scenario.leave_share * len(serving)))
        for i in sorted(world.rng.choice(len(serving), size=count, replace=False)):
            lifecycle.leave(world, serving[int(i)], crash=True)
    elif scenario.event == "region":
        for node in serving:
            if node.city.region == scenario.region:
                lifecycle.leave(world, node, crash=True)


def _record(world: World, t: float, throughput: float, latest: tuple[float, float]) -> None:
    m = world.metrics
    m.times.append(t)
    m.throughput.append(throughput)
    m.bound.append(latest[0])
    m.compute_bound.append(latest[1])
    m.offered.append(world.offered(t))
    m.decoding.append(len(world.decoding))
    m.missing.append(len(world.dht.view(t).missing_blocks()))


def summarize(world: World, scenario: Scenario) -> dict[str, float]:
    """Means over the steady window. ``bound`` is the path LP's (``path_bound``; the per-node one, ``node_bound``,
    where its pricing gave up: ``path_kept_node`` samples); ``ratio`` is ours over it, ``node_ratio`` over the
    per-node one; ``served`` ours over what could be served at best: the bound, or the offered load where that is
    lower (below capacity throughput is what is asked for). After an event (``_recovery``, ``flash_ratio``) the same
    against the path LP (computed up to ``AFTER_EVENT`` on); ``node_``-prefixed keys: against the per-node one."""
    m = world.metrics
    times = np.array(m.times)
    ours, held, compute = np.array(m.throughput), np.array(m.bound), np.array(m.compute_bound)
    steady_end = scenario.event_at if scenario.event else scenario.duration
    steady = (times >= scenario.measure_from) & (times < steady_end)
    tight = np.array(m.path_bound)[steady]
    servable = np.minimum(tight, np.array(m.offered)[steady])
    summary = {
        "throughput": float(ours[steady].mean()),
        "bound": float(tight.mean()),
        "node_bound": float(held[steady].mean()),
        "path_kept_node": float(m.path_kept_node),
        "path_open": float(m.path_open),
        "compute_bound": float(compute[steady].mean()),
        "offered": float(np.array(m.offered)[steady].mean()),
        "ratio": float(ours[steady].mean() / max(tight.mean(), 1e-9)),
        "node_ratio": float(ours[steady].mean() / max(held[steady].mean(), 1e-9)),
        "served": float(ours[steady].mean() / max(servable.mean(), 1e-9)),
        "finished": m.finished,
        "lost": m.lost,
        "refused": m.refused,
        "failovers": m.failovers,
        "moves": m.moves,
        "ttft_p50": float(np.median(m.ttft)) if m.ttft else float("nan"),
    }
    offered = np.array(m.offered)
    node_servable = np.minimum(held, offered)
    # After an event: the path bound where it was computed (``AFTER_EVENT``), the per-node one past that.
    every = np.array(m.path_bound)
    path_servable = np.minimum(np.where(np.isnan(every), held, every), offered)
    if scenario.event in ("leave", "region"):
        # tokens/s served from the event to the end: after it the bounds are steady-state figures that a swarm
        # rebuilding its sessions does not reach, and that fall when its nodes move (a ratio can look good then)
        summary["throughput_after"] = float(ours[times >= scenario.event_at].mean())
        summary |= _recovery(times, ours, path_servable, scenario.event_at)
        summary |= {f"node_{k}": v for k, v in _recovery(times, ours, node_servable, scenario.event_at).items()}
    if scenario.event == "flash":
        window = (times >= scenario.event_at) & (times < scenario.event_at + 60.0)
        summary["flash_ratio"] = float(ours[window].mean() / max(path_servable[window].mean(), 1e-9))
        summary["node_flash_ratio"] = float(ours[window].mean() / max(node_servable[window].mean(), 1e-9))
    return summary


def _recovery(times: np.ndarray, ours: np.ndarray, held: np.ndarray, at: float) -> dict[str, float]:
    """Seconds after the event until our 10 s mean is back above 80 % of ``held`` (what could be served at best),
    and the ratio 2 balance periods on."""
    after = times >= at
    smooth = np.convolve(ours, np.ones(10) / 10, mode="same")
    ratio = np.divide(smooth, held, out=np.zeros_like(smooth), where=held > 0)
    back = np.flatnonzero(after & (ratio >= 0.8) & (times >= at + 5))
    two = after & (times >= at + 2 * BALANCE_PERIOD - 10) & (times < at + 2 * BALANCE_PERIOD + 10)
    return {
        "recovered_after": float(times[back[0]] - at) if len(back) else float("inf"),
        "ratio_at_two_periods": float(ratio[two].mean()) if two.any() else float("nan"),
        "worst_ratio_after": float(ratio[after].min()),
    }
