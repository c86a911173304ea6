"""Where nodes and gateways are, and the round trips between them.

RTT = 2 x (great-circle distance x path stretch) / fibre speed + the last mile at both ends (sim/ASSUMPTIONS.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

FIBRE_KM_PER_S = 200_000.0  # light in glass: about 2/3 of c
PATH_STRETCH = 1.5  # fibre routes are longer than the great circle
EARTH_RADIUS_KM = 6371.0


@dataclass(frozen=True)
class City:
    name: str
    region: str
    lat: float
    lon: float
    share: float  # share of volunteers (and of requests) there


CITIES = (
    City("Ashburn", "na", 39.04, -77.49, 0.10),
    City("Chicago", "na", 41.88, -87.63, 0.05),
    City("Dallas", "na", 32.78, -96.80, 0.04),
    City("San Jose", "na", 37.34, -121.89, 0.08),
    City("Seattle", "na", 47.61, -122.33, 0.04),
    City("Toronto", "na", 43.65, -79.38, 0.04),
    City("Sao Paulo", "sa", -23.55, -46.63, 0.04),
    City("London", "eu", 51.51, -0.13, 0.07),
    City("Amsterdam", "eu", 52.37, 4.90, 0.06),
    City("Frankfurt", "eu", 50.11, 8.68, 0.08),
    City("Paris", "eu", 48.86, 2.35, 0.05),
    City("Helsinki", "eu", 60.17, 24.94, 0.03),
    City("Warsaw", "eu", 52.23, 21.01, 0.03),
    City("Mumbai", "asia", 19.08, 72.88, 0.04),
    City("Singapore", "asia", 1.35, 103.82, 0.05),
    City("Hong Kong", "asia", 22.32, 114.17, 0.04),
    City("Seoul", "asia", 37.57, 126.98, 0.04),
    City("Tokyo", "asia", 35.68, 139.69, 0.06),
    City("Sydney", "oc", -33.87, 151.21, 0.02),
)
GATEWAY_CITIES = ("Ashburn", "San Jose", "Frankfurt", "Singapore")


def distance_km(a: City, b: City) -> float:
    """Great-circle distance (haversine)."""
    p1, p2 = math.radians(a.lat), math.radians(b.lat)
    dp, dl = p2 - p1, math.radians(b.lon - a.lon)
    h = math.sin(dp / 2) ** 2 + math.cos(p1) * math.cos(p2) * math.sin(dl / 2) ** 2
    return 2 * EARTH_RADIUS_KM * math.asin(math.sqrt(h))


def rtt(a: City, b: City, last_mile_a: float, last_mile_b: float) -> float:
    """Seconds for a round trip; ``last_mile_*``: one-way seconds from each end to its city's backbone."""
    return 2 * distance_km(a, b) * PATH_STRETCH / FIBRE_KM_PER_S + 2 * (last_mile_a + last_mile_b)


def sample_city(rng: np.random.Generator) -> City:
    shares = np.array([c.share for c in CITIES])
    return CITIES[rng.choice(len(CITIES), p=shares / shares.sum())]


def sample_last_mile(rng: np.random.Generator, datacenter: bool) -> float:
    """One-way seconds: data centres 0.5 ms; homes lognormal around 5 ms (cable/fibre), a tail past 20 ms (DSL)."""
    return 0.0005 if datacenter else float(rng.lognormal(math.log(0.005), 0.6))


def city(name: str) -> City:
    return next(c for c in CITIES if c.name == name)
