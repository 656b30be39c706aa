"""`bench calibrate --served`: the step model as the live path sees it.

`bench calibrate` measures the engine alone. Live, the engine shares the machine with the
server (its event loop, HTTP, the token streams) and the client: on 2 cores the same batch
through `justitia serve` took twice the time it took the engine alone (3 requests of 1,024
prompt and 128 output tokens: 0.68 s against 0.32 s; one `self_consistency` agent of 13
requests: 3.6 s against the simulator's 1.8 s on the engine-alone profile). A simulator on
the engine-alone profile is then short of every live run, and a fresh server's first ETAs
(its time model starts from the profile) are as short.

So the grid's points of two requests or more are run again through the server, one point
at a time (each point's requests registered as one agent each, together; the next point
after the last is done), and the step model is scaled by the median of their served time
over their engine-alone time. One factor for all four terms: the overhead is the server's
and the client's CPU beside the engine's, which grows with the steps and the tokens
streamed, as the step time does. The factor and each point's times are kept in the profile
file (`served`).

After the points, one agent of `CHAIN_STAGES` one-request stages, each sent when the one before
it has answered, measures the client's turnaround between stages as the server sees it (the
median `pauses.turnaround_p50_s` of `/v1/scheduler`): the profile's `stage_turnaround_s`, the
gap the simulator leaves before each later stage of an agent (server/shared/profiles.py).
`bench calibrate --turnaround` runs that agent alone, the step model left as the engine
alone measured it.

Plain data and arithmetic here; the run through the server is the CLI's (`bench live`'s
runner).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence

from server.shared.profiles import EngineProfile

from .calibrate import PointResult
from .workload import AgentSpec

SERVED_GAP_S = 1.0  # idle time after a point's expected served time before the next starts
SERVED_ROOM = 3.0  # a point's served time is expected within this many times its engine-alone time
CHAIN_ID = "cal-turnaround"  # the agent whose stages measure the client's turnaround
CHAIN_STAGES = 24  # its stages: 23 turnarounds, a median the server's record can hold steady
CHAIN_REQUEST = (16, 2)  # each stage's one request (prompt, output tokens): the gaps, not the steps


def served_points(results: Sequence[PointResult]) -> list[PointResult]:
    """The measured points to run again through the server: those of two requests or more
    (one request alone barely loads the server's path)."""
    return [r for r in results if r.point.batch >= 2]


def served_workload(points: Sequence[PointResult]) -> list[AgentSpec]:
    """Each point's requests as one-request agents arriving together, the points apart by
    `SERVED_ROOM` times their engine-alone time plus `SERVED_GAP_S` (one point at a time);
    then the agent of `CHAIN_STAGES` stages that measures the client's turnaround."""
    agents, t = [], 0.0
    for k, r in enumerate(points):
        pt = r.point
        agents += [AgentSpec(id=f"cal{k}-{i}", type="calibration", arrival=round(t, 3),
                             stages=[[(pt.prompt, pt.output)]], prompt=f"calibration point {k}")
                   for i in range(pt.batch)]
        t += SERVED_ROOM * r.seconds + SERVED_GAP_S
    agents.append(chain_agent(round(t, 3)))
    return agents


def chain_agent(arrival: float = 0.0) -> AgentSpec:
    """The agent of `CHAIN_STAGES` one-request stages, each sent when the one before it has
    answered: the gaps between them are the client's turnaround as the server sees it."""
    return AgentSpec(id=CHAIN_ID, type="calibration-chain", arrival=arrival,
                     stages=[[CHAIN_REQUEST]] * CHAIN_STAGES, prompt="calibration of the turnaround")


def served_rows(points: Sequence[PointResult], finish_s: Mapping[str, float],
                arrival_s: Mapping[str, float]) -> list[dict]:
    """Per point: its engine-alone time, its served time (its first arrival to its last
    agent's finish, the live runner's clock) and their ratio. A point whose agents did not all
    finish is left out."""
    rows = []
    for k, r in enumerate(points):
        ids = [f"cal{k}-{i}" for i in range(r.point.batch)]
        if not all(i in finish_s and i in arrival_s for i in ids):
            continue
        served = max(finish_s[i] for i in ids) - min(arrival_s[i] for i in ids)
        rows.append({"batch": r.point.batch, "prompt": r.point.prompt, "output": r.point.output,
                     "engine_s": r.seconds, "served_s": served, "slowdown": served / r.seconds})
    return rows


def slowdown(rows: Sequence[dict]) -> float:
    """The median served / engine-alone time over the points (ValueError: none)."""
    if not rows:
        raise ValueError("no point ran through the server")
    return statistics.median(row["slowdown"] for row in rows)


def with_turnaround(profile: EngineProfile, turnaround_s: float | None) -> EngineProfile:
    """The profile with the client's turnaround the server measured (ValueError: none was:
    the chained agent's stages never reached the server apart)."""
    if turnaround_s is None or not math.isfinite(turnaround_s) or turnaround_s < 0:
        raise ValueError(f"the server measured no turnaround between stages ({turnaround_s!r})")
    return dataclasses.replace(profile, stage_turnaround_s=turnaround_s)


def scaled(profile: EngineProfile, factor: float) -> EngineProfile:
    """The profile with every term of its step time `factor` times longer."""
    if not factor > 0:
        raise ValueError(f"a slowdown must be positive, not {factor!r}")
    return dataclasses.replace(
        profile.scaled(factor),
        source=f"{profile.source}; x{factor:.2f}, the median slowdown of its points served through the server")
