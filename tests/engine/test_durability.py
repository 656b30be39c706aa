"""An agent the server reported ended is in the history, even if the server is killed
(`kill -9`) right after answering: the finish call returns only once its row is committed."""

from __future__ import annotations

import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from server.launcher import EmbeddedServer

pytestmark = pytest.mark.engine


def _agent(url: str, i: int, stop: threading.Event) -> str | None:
    """One agent, one request; its id once the server said it finished, else None."""
    if stop.is_set():
        return None
    try:
        with httpx.Client(base_url=url, timeout=30) as c:
            rec = c.post("/v1/agents", json={"type": "durable", "prompt": f"p{i}"}).json()
            c.post("/v1/completions", json={"prompt": f"x {i}", "max_tokens": 2},
                   headers={"X-Justitia-Agent": rec["id"]}).raise_for_status()
            r = c.post(f"/v1/agents/{rec['id']}/finish")
            return rec["id"] if r.status_code == 200 and r.json()["state"] == "finished" else None
    except (httpx.HTTPError, KeyError, ValueError):
        return None


def test_agents_reported_finished_survive_kill_9(tmp_path) -> None:
    home = str(tmp_path / "home")
    args = ["--kv-tokens", "2048", "--max-model-len", "512"]
    stop = threading.Event()
    with EmbeddedServer(args, env={"JUSTITIA_HOME": home}) as srv:
        with ThreadPoolExecutor(16) as pool:
            futures = [pool.submit(_agent, srv.url, i, stop) for i in range(400)]
            # Kill mid-batch, once some agents have finished.
            for done, f in enumerate(futures):
                f.result()
                if done == 40:
                    os.kill(srv.process.pid, signal.SIGKILL)
                    stop.set()
                    break
            reported = {f.result() for f in futures} - {None}
        srv.process.wait(30)
        try:  # the engine's processes, left behind by the kill (not this test's subject)
            os.killpg(srv.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert len(reported) >= 40
    with EmbeddedServer(args, env={"JUSTITIA_HOME": home}) as again:
        samples = httpx.get(f"{again.url}/v1/history", params={"agent_type": "durable",
                                                               "limit": 10_000}).json()
    kept = {s["agent_id"] for s in samples["samples"]}
    assert reported <= kept, f"{len(reported - kept)} of {len(reported)} finished agents lost"
