"""A Ray cluster on this machine, in a process of its own, for benchmarks and tests.

`justitia serve --ray local` starts a cluster inside the server's process; a benchmark that
starts one server per policy, or a test module with several servers, wants one cluster for
all of them instead, and one it can stop without touching anyone else's Ray processes on the
machine (`ray stop` stops every cluster of the machine). `LocalCluster` runs `ray.init` in a
child process (loopback only, no token, a capped object store), hands out its address for
`--ray ADDRESS`, and stops it by ending that process and every process under it.

Ray's own start-up gives its raylet 30 s to register, which a busy 2-core machine exceeds
now and then: a failed start is tried again.

Its process helpers also serve `serve --ray local`, whose cluster lives in the server's own
process: `ray_processes_under` finds that cluster's processes and `kill_survivors` ends
those that outlive `ray.shutdown`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from typing import Any

CLUSTER = """
import signal, ray
ray.init(include_dashboard=False, object_store_memory=200 * 1024 * 1024,
         _node_ip_address="127.0.0.1", log_to_driver=False)
print(ray.get_runtime_context().gcs_address, flush=True)
signal.sigwait({signal.SIGTERM, signal.SIGINT})
ray.shutdown()
"""


class LocalCluster:
    """`with LocalCluster() as cluster: ... --ray cluster.address ...`"""

    def __init__(self, attempts: int = 3) -> None:
        self.attempts = attempts
        self.address = ""
        self.process: subprocess.Popen[str] | None = None

    def start(self) -> LocalCluster:
        env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
        for attempt in range(self.attempts):
            self.process = subprocess.Popen([sys.executable, "-c", CLUSTER], stdout=subprocess.PIPE,
                                            env=env, process_group=0, text=True)
            assert self.process.stdout is not None
            self.address = self.process.stdout.readline().strip()
            if self.address:
                return self
            self.stop()
            if attempt == self.attempts - 1:
                raise RuntimeError("the local Ray cluster did not start (see Ray's logs in /tmp/ray)")
        raise AssertionError("unreachable")

    def processes(self) -> list[Any]:
        """Every process of the cluster (Ray's and the workers': engine replicas too)."""
        import psutil

        if self.process is None:
            return []
        try:
            return psutil.Process(self.process.pid).children(recursive=True)
        except psutil.Error:
            return []

    def stop(self) -> None:
        import psutil

        proc, self.process = self.process, None
        if proc is None:
            return
        doomed = []
        with contextlib.suppress(psutil.Error):
            doomed = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        kill_survivors(doomed, grace_s=5.0)  # what ray.shutdown left (some outlive their parents)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def engine_replicas(root_pid: int) -> list[Any]:
    """The processes of Justitia's engine replicas under process `root_pid` (a cluster's or
    a `serve --ray local` server's)."""
    import psutil

    found = []
    for child in psutil.Process(root_pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if "ServeReplica:justitia-engines" in child.name() + " ".join(child.cmdline()[:2]):
                found.append(child)
    return found


def ray_processes_under(pid: int) -> list[Any]:
    """The processes of a Ray cluster that process `pid` started with `ray.init` (its GCS,
    raylet, agents, and under the raylet the workers: engine replicas and their engines)."""
    import psutil

    found = []
    with contextlib.suppress(psutil.Error):
        for proc in psutil.Process(pid).children():
            with contextlib.suppress(psutil.Error):
                if any("site-packages/ray/" in part for part in proc.cmdline()[:3]):
                    found += [proc, *proc.children(recursive=True)]
    return found


def kill_survivors(procs: list[Any], grace_s: float = 3.0) -> None:
    """Kill those of `procs` still alive after `grace_s` seconds."""
    import psutil

    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
