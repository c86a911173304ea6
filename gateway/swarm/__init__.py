"""The swarm client: who serves which blocks (view), which chain to take (routing, bans, router), and driving a
session through that chain (remote sessions, step links, kept chains) with failover.

It speaks tensors and token positions only; it never sees OpenAI types nor the local model (tokenizer, head).
"""
