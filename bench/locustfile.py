"""Locust users for bench/load.py: each streams greedy chat completions and reports, besides the request itself,
time to first token, inter-token latency and end-to-end latency as their own entries (so locust's percentiles
cover them). Configured by env vars set by bench/load.py: SWARMGATE_MODEL, SWARMGATE_MAX_TOKENS, SWARMGATE_KEY.
"""

from __future__ import annotations

import json
import os
import random
import time

from locust import HttpUser, between, task

PROMPTS = [
    "Name three colours.",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me a fun fact about octopuses.",
    "Count from 1 to 5.",
    "What is 2 + 2?",
]


class ChatUser(HttpUser):
    wait_time = between(0.5, 2.0)

    @task
    def chat(self) -> None:
        body = {
            "model": os.environ["SWARMGATE_MODEL"],
            "messages": [{"role": "user", "content": random.choice(PROMPTS)}],
            "max_tokens": int(os.environ.get("SWARMGATE_MAX_TOKENS", "16")),
            "temperature": 0,
            "stream": True,
        }
        headers = {"Authorization": f"Bearer {os.environ.get('SWARMGATE_KEY', 'none')}"}
        began = time.perf_counter()
        arrivals: list[float] = []
        with self.client.post(
            "/v1/chat/completions", json=body, headers=headers, stream=True, catch_response=True, name="chat stream"
        ) as response:
            if response.status_code == 429:
                response.success()  # deliberate backpressure: counted apart by its own entry
                self._report("429 (backpressure)", 0.0)
                return
            if response.status_code != 200:
                response.failure(f"HTTP {response.status_code}: {response.text[:200]}")
                return
            for line in response.iter_lines():
                if not line or not line.startswith(b"data: "):
                    continue
                payload = line[6:]
                if payload == b"[DONE]":
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    response.failure(f"error event: {chunk['error'].get('code')}")
                    return
                if any(choice["delta"].get("content") for choice in chunk.get("choices", [])):
                    arrivals.append(time.perf_counter())
            else:
                response.failure("stream ended without [DONE]")
                return
            response.success()
        if arrivals:
            self._report("time to first token", (arrivals[0] - began) * 1000)
            for earlier, later in zip(arrivals, arrivals[1:], strict=False):
                self._report("inter-token latency", (later - earlier) * 1000)
            self._report("end-to-end", (arrivals[-1] - began) * 1000)

    def _report(self, name: str, milliseconds: float) -> None:
        self.environment.events.request.fire(
            request_type="METRIC", name=name, response_time=milliseconds, response_length=0, exception=None
        )
