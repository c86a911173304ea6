"""The gateway: tokenizer, embeddings, LM head and sampling locally; the blocks through the swarm; an OpenAI API."""
