"""`bench live --ray --kill-scheduler-after S`: the scheduler's process killed mid-replay.

`SchedulerRestart` plays the scheduler's supervisor: S seconds into the replay it kills the
server process (SIGKILL: no shutdown, as an OOM kill or a lost node would), then starts the
same `justitia serve --ray ADDRESS ...` on the same port, which finds the engine replicas
still running on Ray and schedules onto them. The replay's agents meet what clients meet:
requests in flight at the kill fail, agents the new scheduler does not know answer 404, and
agents arriving while it is down register once it is back.

The application the killed server deployed outlives it; the restarted server only attached
to it and leaves it running when it stops, so `delete_engines` removes it before the next
policy's server deploys its own (a child process does it: this command never imports Ray).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

DELETE_APP = """
import sys, ray
from ray import serve
ray.init(address=sys.argv[1], log_to_driver=False, logging_level="ERROR")
serve.delete(sys.argv[2])
"""


class SchedulerRestart:
    """Kill the server `srv` (an EmbeddedServer) after some seconds and start it again."""

    def __init__(self, srv: Any, startup_timeout_s: float, log_path: Path | None) -> None:
        self.srv = srv
        self.startup_timeout_s = startup_timeout_s
        self.log_path = log_path
        self.again: Any = None

    async def kill_later(self, t0: float, after_s: float) -> dict[str, Any]:
        from server.launcher import EmbeddedServer

        await asyncio.sleep(max(0.0, t0 + after_s - time.monotonic()))
        proc = self.srv.process
        killed_at = time.monotonic() - t0
        proc.send_signal(signal.SIGKILL)
        await asyncio.to_thread(proc.wait, 30)
        log = self.log_path.with_name(self.log_path.stem + "-after-kill.log") if self.log_path else None
        self.again = EmbeddedServer(self.srv.args, port=self.srv.port, env=self.srv.env,
                                    startup_timeout=self.startup_timeout_s, log_path=log)
        await asyncio.to_thread(self.again.start)
        return {"pid": proc.pid, "at_s": round(killed_at, 2),
                "back_after_s": round(time.monotonic() - t0 - killed_at, 2)}

    def stop(self) -> None:
        if self.again is not None:
            self.again.stop()


def delete_engines(address: str, app_name: str = "justitia-engines", timeout_s: float = 300.0) -> None:
    """Remove the engine application from the Ray cluster at `address`."""
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    subprocess.run([sys.executable, "-c", DELETE_APP, address, app_name], env=env, timeout=timeout_s,
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
