"""Workload files (DESIGN section 8): JSON Lines, one agent per line.

    {"id": "a17", "type": "mapreduce_summary", "arrival": 12.5, "prompt": "...",
     "stages": [[{"p": 812, "d": 120}, {"p": 790, "d": 118}], [{"p": 300, "d": 256}]]}

Stages run one after another, the requests of a stage in parallel. Extra fields are ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from server.scheduler.cost import compute_cost, kv_cost


@dataclass
class AgentSpec:
    id: str
    type: str
    arrival: float
    stages: list[list[tuple[int, int]]]  # [(p, d), ...] per stage
    prompt: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def kv_cost(self) -> float:
        return sum(kv_cost(p, d) for st in self.stages for p, d in st)

    @property
    def compute_cost(self) -> float:
        return sum(compute_cost(p, d) for st in self.stages for p, d in st)

    @property
    def critical_path_tokens(self) -> int:
        return sum(max(d for _, d in st) for st in self.stages if st)

    @property
    def num_requests(self) -> int:
        return sum(len(st) for st in self.stages)

    def to_json(self) -> dict:
        out = {"id": self.id, "type": self.type, "arrival": round(self.arrival, 6)}
        if self.prompt:
            out["prompt"] = self.prompt
        out["stages"] = [[{"p": p, "d": d} for p, d in st] for st in self.stages]
        out.update(self.extra)
        return out


class WorkloadError(ValueError):
    """A workload file that does not follow DESIGN section 8."""


def parse_agent(obj: dict, where: str = "") -> AgentSpec:
    try:
        stages = [[(int(r["p"]), int(r["d"])) for r in st] for st in obj["stages"]]
        agent = AgentSpec(
            id=str(obj["id"]),
            type=str(obj.get("type", "unknown")),
            arrival=float(obj["arrival"]),
            stages=[st for st in stages if st],
            prompt=str(obj.get("prompt") or ""),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise WorkloadError(f"{where}: expected id, arrival and stages of {{p, d}} ({exc})") from None
    for st in agent.stages:
        for p, d in st:
            if p < 0 or d < 1:
                raise WorkloadError(f"{where}: agent {agent.id}: need p >= 0 and d >= 1")
    if agent.arrival < 0:
        raise WorkloadError(f"{where}: agent {agent.id}: negative arrival")
    return agent


def load_workload(path: str | Path) -> list[AgentSpec]:
    """Read a workload file; agents come back sorted by arrival (stable)."""
    agents = []
    seen = set()
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise WorkloadError(f"{path}:{n}: not JSON ({exc.msg})") from None
            agent = parse_agent(obj, f"{path}:{n}")
            if agent.id in seen:
                raise WorkloadError(f"{path}:{n}: duplicate agent id {agent.id!r}")
            seen.add(agent.id)
            agents.append(agent)
    agents.sort(key=lambda a: a.arrival)
    return agents


def save_workload(agents: list[AgentSpec], path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for a in agents:
            fh.write(json.dumps(a.to_json()) + "\n")
