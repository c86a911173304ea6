"""What arrives and what leaves: node session lengths (churn) and client sessions (requests), from documented
distributions (sim/ASSUMPTIONS.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# Node uptime: Lomax (Pareto II) with shape 1.5 (heavy tail: most volunteers stay an hour or less, a few for days).
UPTIME_SHAPE = 1.5
UPTIME_MEDIAN = {True: 6 * 3600.0, False: 1 * 3600.0}  # data centre / home
CRASH_SHARE = 0.3  # leavers that vanish (crash, network) instead of draining on SIGTERM
PROMPT_MEDIAN, PROMPT_SIGMA, PROMPT_RANGE = 512, 1.0, (16, 8192)
OUTPUT_MEDIAN, OUTPUT_SIGMA, OUTPUT_RANGE = 200, 0.8, (8, 2048)
BURST_EVERY, BURST_LENGTH, BURST_FACTOR = 300.0, 30.0, 3.0  # a busy spell: mean gap, length, arrival-rate factor


def uptime(rng: np.random.Generator, datacenter: bool) -> float:
    """Seconds a node serves before it leaves (Lomax: median = scale x (2^(1/shape) - 1))."""
    scale = UPTIME_MEDIAN[datacenter] / (2 ** (1 / UPTIME_SHAPE) - 1)
    return float(scale * rng.pareto(UPTIME_SHAPE))


def mean_uptime(datacenter: bool) -> float:
    return UPTIME_MEDIAN[datacenter] / (2 ** (1 / UPTIME_SHAPE) - 1) / (UPTIME_SHAPE - 1)


@dataclass(frozen=True)
class Request:
    prompt: int
    output: int

    @property
    def max_length(self) -> int:
        return self.prompt + self.output


def _lognormal(rng: np.random.Generator, median: float, sigma: float, bounds: tuple[int, int]) -> int:
    return int(np.clip(rng.lognormal(math.log(median), sigma), *bounds))


def sample_request(rng: np.random.Generator) -> Request:
    return Request(
        _lognormal(rng, PROMPT_MEDIAN, PROMPT_SIGMA, PROMPT_RANGE),
        _lognormal(rng, OUTPUT_MEDIAN, OUTPUT_SIGMA, OUTPUT_RANGE),
    )


def mean_request(samples: int = 20_000, seed: int = 0) -> tuple[float, float]:
    """Mean output tokens, and the KV tokens a decoded token costs per second of holding: E[max_length x output] /
    E[output] (estimated once by sampling the clipped lognormals).

    A session holds its max_length on a node for as long as it decodes, output / rate seconds, so a node of ``pool``
    tokens whose sessions each decode at most ``r`` tokens/s gives at most ``pool x r / that length`` tokens/s
    (Little's law over sessions, weighted by how long each holds). It is longer than the mean max_length: long
    outputs hold the pool longest."""
    rng = np.random.default_rng(seed)
    requests = [sample_request(rng) for _ in range(samples)]
    outputs = np.array([r.output for r in requests], dtype=float)
    held = np.array([r.max_length for r in requests], dtype=float) * outputs
    return float(outputs.mean()), float(held.mean() / outputs.mean())


class Arrivals:
    """Poisson session arrivals at ``rate``/s, times ``BURST_FACTOR`` during busy spells (themselves Poisson), and
    times any flash-crowd factor a scenario sets for a window."""

    def __init__(self, rng: np.random.Generator, rate: float, horizon: float) -> None:
        self.rng = rng
        self.rate = rate
        self.bursts: list[tuple[float, float, float]] = []  # (from, to, factor)
        t = float(rng.exponential(BURST_EVERY))
        while t < horizon:
            self.bursts.append((t, t + BURST_LENGTH, BURST_FACTOR))
            t += BURST_LENGTH + float(rng.exponential(BURST_EVERY))

    def add_window(self, start: float, end: float, factor: float) -> None:
        self.bursts.append((start, end, factor))

    def factor(self, now: float) -> float:
        return math.prod(f for a, b, f in self.bursts if a <= now < b)

    def next_gap(self, now: float) -> float:
        """Seconds to the next arrival (thinning against the highest factor that may apply)."""
        peak = self.rate * max([1.0] + [f for _, _, f in self.bursts]) ** 2
        t = now
        while True:
            t += float(self.rng.exponential(1 / peak))
            if self.rng.random() < self.rate * self.factor(t) / peak:
                return t - now
