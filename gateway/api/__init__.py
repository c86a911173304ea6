"""The OpenAI-compatible HTTP layer: protocol models, serving classes, thin routers, and the error edge.

routes → serving → ``gateway.generation.Engine`` (an interface): nothing here imports torch, hivemind or the engine.
"""
