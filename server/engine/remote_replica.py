"""What a vLLM OpenAI server says about itself: its model, its KV cache, its health, its pace.

- at start: the model (`/v1/models`) and the KV capacity, (num_gpu_blocks - 1) x block_size
  from the `vllm:cache_config_info` metric (one block is vLLM's reserve);
- while serving, polled: its metrics (KV use, running and waiting requests, preemptions) and
  whether it answers at all. Between two polls a server that kept `r` requests running for
  `dt` seconds and generated `g` tokens took about `dt * r / g` seconds per step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import aiohttp

from server.engine.base import EngineError, EngineStats


def parse_metrics(text: str) -> tuple[dict[str, float], dict[str, str]]:
    """Sum of each vllm: metric over its label sets, and the cache_config_info labels."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    cache: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.startswith("vllm:"):
                continue
            if sample.name == "vllm:cache_config_info":
                cache = dict(sample.labels)
            values[sample.name] = values.get(sample.name, 0.0) + float(sample.value)
    return values, cache


@dataclass
class RemoteReplica:
    url: str
    model: str = ""
    served_name: str = ""  # the model's id in the server's /v1/models
    kv_capacity_tokens: int = 0
    block_size: int = 16
    max_model_len: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    last_poll: float | None = None

    def stats(self) -> EngineStats:
        m = self.metrics
        return EngineStats(kv_usage=m.get("vllm:kv_cache_usage_perc", 0.0),
                           running=int(m.get("vllm:num_requests_running", 0)),
                           waiting=int(m.get("vllm:num_requests_waiting", 0)),
                           preemptions_total=int(m.get("vllm:num_preemptions_total", 0)))

    async def describe(self, session: aiohttp.ClientSession) -> None:
        """Read the model and the KV cache (EngineError if it does not answer as a vLLM
        OpenAI server)."""
        try:
            async with session.get(self.url + "/v1/models") as resp:
                models = (await resp.json())["data"]
            async with session.get(self.url + "/metrics") as resp:
                values, cache = parse_metrics(await resp.text())
        except (TimeoutError, aiohttp.ClientError, KeyError, ValueError) as exc:
            raise EngineError(f"replica {self.url} did not answer as a vLLM OpenAI server: {exc}") from exc
        if not models or "num_gpu_blocks" not in cache:
            raise EngineError(f"replica {self.url} reports no model or no KV cache configuration (is it "
                              "running with --disable-log-stats? Justitia reads its /metrics)")
        self.model = models[0].get("root") or models[0]["id"]
        self.served_name = models[0]["id"]
        self.max_model_len = int(models[0].get("max_model_len") or 0)
        self.block_size = int(cache.get("block_size", 16))
        self.kv_capacity_tokens = (int(cache["num_gpu_blocks"]) - 1) * self.block_size
        self.metrics = values
        self.last_poll = time.monotonic()

    async def poll(self, session: aiohttp.ClientSession) -> tuple[bool, float | None]:
        """(it answers, the seconds per step since the last poll when it was busy)."""
        now = time.monotonic()
        try:
            async with session.get(self.url + "/metrics", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                values, _ = parse_metrics(await resp.text())
        except (TimeoutError, aiohttp.ClientError, ValueError):
            return False, None
        before, then = self.metrics, self.last_poll
        self.metrics, self.last_poll = values, now
        if then is None:
            return True, None
        running = (before.get("vllm:num_requests_running", 0) + values.get("vllm:num_requests_running", 0)) / 2
        generated = values.get("vllm:generation_tokens_total", 0) - before.get("vllm:generation_tokens_total", 0)
        if running >= 1 and generated > 0:
            return True, (now - then) * running / generated
        return True, None
