"""The gateway's memory in Redis: session records, their event streams, cancellation, API keys and quotas."""
