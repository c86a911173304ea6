"""A swarm node: hosts a span of transformer blocks, announces it in the DHT and serves inference RPCs."""
