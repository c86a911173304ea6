"""Code common to the swarm node and the gateway: model families, span loading, DHT records, wire protocol."""

__version__ = "0.1.0"
