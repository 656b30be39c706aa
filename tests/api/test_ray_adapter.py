"""The Ray Serve adapter without Ray: its KV ledger, placement, capacity and the options.

The adapter (server/engine/ray_serve.py) keeps the KV ledger of the engine replicas in the
scheduler's process; these tests drive it with the reports the replicas would send, so the
fast tier never imports Ray (checked at the end). The engine tier (tests/engine/test_ray.py)
runs the same adapter on a local Ray cluster with real vLLM replicas.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from justitia_cli import main
from server.engine.base import Capabilities
from server.engine.ray_serve import RayServeEngine, RayUnreachable, check_reachable
from server.launcher import free_port
from server.scheduler.time_model import TimeModelBank
from server.shared.step_time import StepSample


def report(rid: str, kv: int = 4000, healthy: bool = True, steps: list | None = None,
           samples: list | None = None) -> dict:
    return {"replica": rid, "healthy": healthy, "pid": 1, "node": 0, "steps": steps or [],
            "samples": samples or [],
            "info": {"model": "m", "kv_capacity_tokens": kv, "block_size": 32, "max_model_len": 1024},
            "stats": {"kv_usage": 0.5, "running": 2, "waiting": 0, "preemptions_total": 0,
                      "iteration_time_s": 0.01, "steps_total": 10}}


def engine_of(*reports: dict, pinned: bool = True) -> tuple[RayServeEngine, list[int]]:
    engine = RayServeEngine("local", len(reports), {}, pinned=pinned)
    heard: list[int] = []
    engine.add_capacity_listener(heard.append)
    engine.absorb(list(reports))
    engine.placement.started()
    engine.state = "running"
    return engine, heard


def test_capabilities_are_those_the_scheduler_needs() -> None:
    engine, _ = engine_of(report("a"))
    assert Capabilities.of(engine).names == {"placement", "capacity_changes", "step_statistics", "step_samples",
                                             "supervision", "replicas", "autoscaled"}


def test_m_is_the_sum_and_follows_replicas_leaving_and_joining() -> None:
    engine, heard = engine_of(report("a"), report("b"))
    assert engine.capacity == 8000
    engine.absorb([report("a")])  # b stopped reporting (killed)
    assert engine.capacity == 4000 and heard == [4000]
    engine.absorb([report("a"), report("c", kv=4000)])  # Ray replaced it
    assert engine.capacity == 8000 and heard == [4000, 8000]
    engine.absorb([])  # none left: M keeps its value, requests wait for Ray
    assert heard == [4000, 8000] and engine.state == "restarting" and engine.recovering
    engine.absorb([report("d")])
    assert engine.state == "running" and heard[-1] == 4000


def reserved(engine: RayServeEngine) -> dict[str, int]:
    return {r["id"]: r["reserved_tokens"] for r in engine.describe_replicas()}


def test_placement_is_the_shared_one_on_the_replicas_that_report() -> None:
    engine, _ = engine_of(report("a"), report("b"))
    assert engine.place("r1", "agent1", 3000)
    [first] = [rid for rid, tokens in reserved(engine).items() if tokens == 3000]
    assert engine.place("r2", "agent1", 900)  # same agent, its replica still has room
    assert reserved(engine)[first] == 3900
    assert engine.place("r3", "agent2", 3900)  # only the other replica has room
    assert not engine.place("r4", "agent3", 2000)  # 7,800 of 8,000 reserved, split 3,900 / 3,900
    engine.release("r3")
    assert engine.place("r4", "agent3", 2000)
    # a replica that stops reporting while it holds a placement stays listed, down, until
    # the request ends elsewhere
    engine.absorb([report("a" if first == "b" else "b")])
    rows = {r["id"]: r for r in engine.describe_replicas()}
    assert rows[first]["state"] == "down" and rows[first]["reserved_tokens"] == 3900
    assert engine.capacity == 4000


def test_the_schedulers_demand_goes_to_the_replicas_with_every_poll() -> None:
    """With --min/--max-replicas the replicas hand it to Ray Serve's autoscaler."""
    engine, heard = engine_of(report("a"))
    sent: list[tuple] = []

    class Broadcast:
        async def results_async(self, **_: object) -> list:
            return [report("a"), report("b")]

    class Handle:
        def broadcast(self, method: str, *args: object) -> Broadcast:
            sent.append((method, *args))
            return Broadcast()

    engine.handle = Handle()  # stands in for Ray Serve's: the fast tier never imports Ray
    engine.set_demand_source(lambda: 12_345)
    assert asyncio.run(engine.poll())
    assert sent == [("report", 12_345)]
    # Ray scaled up: M follows, and the change is on record with the replica count
    assert heard == [8000] and engine.capacity == 8000
    assert [(c["replicas"], c["M"]) for c in engine.capacity_changes()] == [(1, 4000), (2, 8000)]


def test_unpinned_engine_reserves_nothing() -> None:
    engine, _ = engine_of(report("a"), report("b"), pinned=False)
    assert engine.place("r1", "agent1", 10**9)
    assert all(r.reserved == 0 for r in engine.placement.replicas.values())


def test_step_reports_reach_the_rate_estimator_scaled_to_the_whole_m() -> None:
    engine = RayServeEngine("local", 2, {})
    steps: list[tuple[float, float]] = []
    engine.add_step_listener(lambda s, kv: steps.append((s, kv)))
    engine.absorb([report("a", steps=[[0.02, 1000.0]]), report("b")])
    assert steps == [(0.02, 2000.0)]  # 1,000 of replica a's 4,000: a quarter of M = 8,000


def test_step_samples_of_each_replica_feed_its_own_time_model_scaled_to_the_whole_m() -> None:
    """The replicas' steps reach the scheduler's time models (one per replica, by its id)
    through the capability the server subscribes to, as the in-process engine's do."""
    engine = RayServeEngine("local", 2, {})
    bank = TimeModelBank()
    caps = Capabilities.of(engine)
    assert caps.step_samples is not None
    caps.step_samples.add_sample_listener(bank.observe)
    heard: list[tuple[str, StepSample]] = []
    engine.add_sample_listener(lambda name, s: heard.append((name, s)))
    # replica a: 8 decoding sequences over 1,000 KV tokens at 10 ms a step; b: twice the time
    a_steps = [[0.010, 8, 0, 1000.0]] * 64  # the fits refit every 32 steps
    b_steps = [[0.020, 8, 64, 1000.0]] * 64
    engine.absorb([report("a", samples=a_steps), report("b", samples=b_steps)])
    # each replica's step is the fleet's (M = 8,000, twice a replica's): the batch doubled
    assert heard[0] == ("a", StepSample(0.010, 16, 0, 2000.0))
    assert heard[-1] == ("b", StepSample(0.020, 16, 128, 2000.0))
    described = bank.describe()["engines"]
    assert set(described) == {"a", "b"}
    assert described["a"]["samples"] == described["b"]["samples"] == 64
    models = bank.models()
    # fitted to what each replica measured, not the prior (the slower replica predicts slower)
    assert models["a"].predict(StepSample(0, 16, 0, 2000.0)) == pytest.approx(0.010, rel=0.1)
    assert models["b"].predict(StepSample(0, 16, 128, 2000.0)) == pytest.approx(0.020, rel=0.1)
    # a report without samples (a replica that sends none) is read as before
    engine.absorb([{k: v for k, v in report("a").items() if k != "samples"}, report("b")])
    assert len(heard) == 128


def test_an_unreachable_address_is_a_clear_error() -> None:
    port = free_port()  # nothing listens there
    with pytest.raises(RayUnreachable, match="cannot reach the Ray cluster"):
        check_reachable(f"127.0.0.1:{port}", timeout_s=2)
    with pytest.raises(RayUnreachable, match="not an address"):
        check_reachable("nonsense")


def test_serve_options_of_ray(capsys: pytest.CaptureFixture) -> None:
    assert main(["serve", "--replicas", "2"]) == 2
    assert "add --ray" in capsys.readouterr().err
    assert main(["serve", "--policy", "ray"]) == 2
    assert "needs --ray" in capsys.readouterr().err
    assert main(["serve", "--ray", "local", "--min-replicas", "1"]) == 2
    assert "go together" in capsys.readouterr().err
    assert main(["serve", "--ray", "local", "--replicas", "2", "--kv-tokens", "2048"]) == 2
    assert "below --max-model-len" in capsys.readouterr().err
    assert main(["serve", "--ray", f"127.0.0.1:{free_port()}"]) == 2
    assert "cannot reach the Ray cluster" in capsys.readouterr().err
    # several engine replicas are Ray's: one external vLLM server at most
    assert main(["serve", "--engine-url", "http://127.0.0.1:1", "--engine-url", "http://127.0.0.1:2"]) == 2
    assert "one --engine-url" in capsys.readouterr().err


def test_bench_takes_policy_ray_only_with_ray(tmp_path, capsys: pytest.CaptureFixture) -> None:
    workload = tmp_path / "w.jsonl"
    workload.write_text('{"id": "a", "type": "t", "arrival": 0, "stages": [[{"p": 10, "d": 4}]]}\n')
    assert main(["bench", "sim", "--workload", str(workload), "--policies", "ray", "--kv-tokens", "4096"]) == 2
    assert "bench live --ray" in capsys.readouterr().err
    assert main(["bench", "live", "--workload", str(workload), "--policies", "justitia",
                 "--kv-tokens", "4096", "--kill-replica-after", "5"]) == 2
    assert "add --ray" in capsys.readouterr().err
    assert main(["bench", "live", "--workload", str(workload), "--policies", "justitia",
                 "--kv-tokens", "4096", "--kill-scheduler-after", "5"]) == 2
    assert "--kill-scheduler-after kills a process of Justitia on Ray: add --ray" in capsys.readouterr().err
    assert main(["bench", "live", "--workload", str(workload), "--policies", "justitia", "--ray",
                 "--kv-tokens", "4096", "--max-model-len", "1024", "--kill-scheduler-after", "-1"]) == 2
    assert "must be seconds >= 0" in capsys.readouterr().err


@pytest.mark.slow
def test_the_fast_tier_does_not_import_ray() -> None:
    code = ("import sys, server.api.app, server.cli, server.engine.ray_serve, server.engine.ray_cluster, "
            "justitia_cli.bench.commands, justitia_cli.bench.live, justitia_cli.bench.live_run;"
            "sys.exit('ray' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
