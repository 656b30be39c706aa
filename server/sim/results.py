"""What a simulated (or live) run of one policy produced: per agent its arrival, finish, GPS
finish time, bound, ETA and promise; per policy the summary `bench` reports (DESIGN section 8's
`results`), with Jain's index of slowdowns and the ETAs' coverage."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from server.scheduler.tight_promise import PromiseParts


@dataclass
class AgentResult:
    id: str
    type: str
    arrival_s: float
    finish_s: float
    gps_finish_s: float
    delay_bound_s: float
    # What the scheduler told the agent when it arrived, as durations from its arrival.
    first_eta_s: float | None = None
    first_deadline_s: float | None = None
    # The agent's JCT alone on an idle engine (`isolated_jct_s`): the denominator of its slowdown.
    isolated_s: float | None = None
    # [p10, p90] given with the first ETA, seconds from its arrival (DESIGN section 8).
    first_eta_interval_s: tuple[float, float] | None = None
    # prompt tokens prefilled again that the engine had computed for this agent before
    reprefill_tokens: int = 0
    # The client's tool time the first deadline allowed (None: not known) and the time the
    # agent spent paused in all (tool calls, think time between stages).
    first_tool_allowance_s: float | None = None
    paused_s: float = 0.0
    # What the first deadline was made of (the scheduler's `PromiseParts`; None: not known,
    # as in a live run): how another rule would have promised is computed from it.
    first_promise: PromiseParts | None = None

    @property
    def jct_s(self) -> float:
        return self.finish_s - self.arrival_s

    @property
    def slowdown(self) -> float | None:
        """JCT over the agent's own time on an idle engine (1: it waited for no one)."""
        if self.isolated_s is None or self.isolated_s <= 0:
            return None
        return self.jct_s / self.isolated_s

    @property
    def eta_error(self) -> float | None:
        """|first ETA - JCT| / JCT."""
        bias = self.eta_bias
        return abs(bias) if bias is not None else None

    @property
    def eta_bias(self) -> float | None:
        """(first ETA - JCT) / JCT: below 0 the agent was told too short a time."""
        if self.first_eta_s is None or self.jct_s <= 0:
            return None
        return (self.first_eta_s - self.jct_s) / self.jct_s

    @property
    def promise_kept(self) -> bool | None:
        if self.first_deadline_s is None:
            return None
        return self.jct_s <= self.first_deadline_s + 1e-6

    @property
    def promise_broken_by_tools(self) -> bool:
        """The promise broke, and would have held had the client's tool time kept within what
        the promise allowed: the JCT less the tool time beyond the allowance is within the
        deadline (the server kept the engine's part; the client's calls took longer)."""
        if self.promise_kept is not False or self.first_tool_allowance_s is None or self.first_deadline_s is None:
            return False
        beyond = max(0.0, self.paused_s - self.first_tool_allowance_s)
        return self.jct_s - beyond <= self.first_deadline_s + 1e-6

    def as_dict(self) -> dict:
        return {
            "id": self.id,
            "type": self.type,
            "arrival_s": self.arrival_s,
            "finish_s": self.finish_s,
            "jct_s": self.jct_s,
            "gps_finish_s": self.gps_finish_s,
            "delay_bound_s": self.delay_bound_s,
            "first_eta_s": self.first_eta_s,
            "first_deadline_s": self.first_deadline_s,
            "first_eta_interval_s": list(self.first_eta_interval_s) if self.first_eta_interval_s else None,
            "isolated_s": self.isolated_s,
            "slowdown": self.slowdown,
            "reprefill_tokens": self.reprefill_tokens,
            "first_tool_allowance_s": self.first_tool_allowance_s,
            "paused_s": self.paused_s,
            **({"first_promise": asdict(self.first_promise)} if self.first_promise is not None else {}),
        }


@dataclass
class PolicyResult:
    policy: str
    agents: list[AgentResult]
    iterations: int = 0
    preemptions: int = 0
    accounting_zero: bool = True
    sim_wall_s: float = 0.0
    extra: dict = field(default_factory=dict)

    def summary(self) -> dict:
        jcts = sorted(a.jct_s for a in self.agents)
        eta_errors = sorted(e for a in self.agents if (e := a.eta_error) is not None)
        eta_biases = sorted(b for a in self.agents if (b := a.eta_bias) is not None)
        return {
            "policy": self.policy,
            "mean_jct_s": statistics.fmean(jcts) if jcts else 0.0,
            "p50_jct_s": quantile(jcts, 0.50),
            "p90_jct_s": quantile(jcts, 0.90),
            "p99_jct_s": quantile(jcts, 0.99),
            "max_jct_s": jcts[-1] if jcts else 0.0,
            "makespan_s": max((a.finish_s for a in self.agents), default=0.0),
            "bound_violations": sum(a.finish_s > a.gps_finish_s + a.delay_bound_s + 1e-6 for a in self.agents),
            "max_lag_vs_gps_s": max((a.finish_s - a.gps_finish_s for a in self.agents), default=0.0),
            "eta_error_p50": quantile(eta_errors, 0.50) if eta_errors else None,
            "eta_error_p90": quantile(eta_errors, 0.90) if eta_errors else None,
            # the signed error's median: which way the first ETAs miss (negative: too short)
            "eta_bias_p50": quantile(eta_biases, 0.50) if eta_biases else None,
            "eta_coverage": eta_coverage(self.agents),
            "promises_kept": sum(a.promise_kept is True for a in self.agents),
            # broken only by the client's tool time beyond what the promise allowed
            "promises_broken_by_tools": sum(a.promise_broken_by_tools for a in self.agents),
            "reprefill_tokens": sum(a.reprefill_tokens for a in self.agents),
            "jain_slowdown": jain_index([s for a in self.agents if (s := a.slowdown) is not None]),
            "max_slowdown": max((s for a in self.agents if (s := a.slowdown) is not None), default=None),
            "iterations": self.iterations,
            "preemptions": self.preemptions,
            "accounting_zero": self.accounting_zero,
            "sim_wall_s": self.sim_wall_s,
            **self.extra,
        }

    def as_dict(self) -> dict:
        return {**self.summary(), "agents": [a.as_dict() for a in self.agents]}


def eta_coverage(agents: Sequence[AgentResult]) -> float | None:
    """The share of agents whose JCT fell inside their first ETA interval (None: no intervals)."""
    inside = [lo - 1e-9 <= a.jct_s <= hi + 1e-9 for a in agents
              if a.first_eta_interval_s is not None for lo, hi in [a.first_eta_interval_s]]
    return sum(inside) / len(inside) if inside else None


def jain_index(xs: Sequence[float]) -> float | None:
    """Jain's fairness index (sum x)^2 / (n sum x^2): 1 when all are equal, 1/n when one
    value holds everything (None for no values)."""
    if not xs:
        return None
    square_sum = sum(x * x for x in xs)
    return sum(xs) ** 2 / (len(xs) * square_sum) if square_sum > 0 else 1.0


def quantile(sorted_xs: list[float], q: float) -> float:
    """Linear-interpolation quantile (numpy's default)."""
    if not sorted_xs:
        return 0.0
    pos = q * (len(sorted_xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)
