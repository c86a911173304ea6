"""The gateway's share of the model and the generation loop: tokens, embeddings + LM head (and its batcher),
sampling, and the engine that drives a prompt through the swarm client token by token.
"""
