"""Justitia's scheduler core: pure, clock-free, shared by the live server and the simulator.

- `cost`: KV token-time and compute-token cost of a request.
- `virtual_clock`: the GPS virtual clock (virtual finish tags, O(log n) per event).
- `tenant_clock`: hierarchical GPS (tenants weighted, then their agents); the flat clock
  while there is one tenant.
- `gps_reference`: exact offline GPS fluid simulations, flat and hierarchical (the references
  in tests).
- `policies`: ordering keys and admission rules of fcfs, sjf, vtc, parrot, srjf, justitia,
  justitia-c, and the stateful baselines ewsjf and equinox.
- `ewsjf`, `tuner`: EWSJF's partitioning, group queues and online (Thompson sampling) tuner.
- `bounds`: the per-agent delay bound in seconds.
- `state`: the scheduler's state (requests and their status, agents, views, the narrow
  context policies see).
- `queues`: the queue protocol the dispatcher admits from (agent heap; ewsjf's group queues).
- `dispatcher`: pending requests, admission into the engine, per-agent views.
- `rate`: the online estimate of tau (the GPS rate's iteration time) for the live server.
"""

from .bounds import AgentShape, BoundLimits, DelayBound, delay_bound
from .cost import COMPUTE, KV, compute_cost, cost_function, decode_for_kv_cost, kv_cost, kv_footprint
from .dispatcher import Dispatcher
from .gps_reference import gps_finish_times, hierarchical_gps_finish_times
from .policies import LIVE_ONLY, POLICIES, POLICY_NAMES, Policy, get_policy
from .queues import AgentHeapQueue, RequestQueue
from .rate import TauEstimator
from .state import AgentState, AgentView, PromiseKind, RequestSpec, RequestState, RequestStatus, SchedulerContext
from .tenant_clock import TenantClock
from .virtual_clock import VirtualClock

__all__ = [
    "AgentHeapQueue",
    "AgentShape",
    "AgentState",
    "AgentView",
    "BoundLimits",
    "COMPUTE",
    "DelayBound",
    "Dispatcher",
    "KV",
    "POLICIES",
    "POLICY_NAMES",
    "LIVE_ONLY",
    "Policy",
    "PromiseKind",
    "RequestQueue",
    "RequestSpec",
    "RequestState",
    "RequestStatus",
    "SchedulerContext",
    "TauEstimator",
    "TenantClock",
    "VirtualClock",
    "compute_cost",
    "cost_function",
    "decode_for_kv_cost",
    "delay_bound",
    "get_policy",
    "gps_finish_times",
    "hierarchical_gps_finish_times",
    "kv_cost",
    "kv_footprint",
]
