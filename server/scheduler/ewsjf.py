"""EWSJF's machinery: refine-and-prune partitioning, per-group queues, the density-weighted
score and the online tuning of its parameters.

EWSJF ("Effective Workload-based Shortest Job First", Sidik, Levi and Kampeas, arXiv
2601.21758) is a request-level scheduler that sits in front of vLLM's own. What the paper's
abstract states, and what this module implements in its own way (docs/concepts.md lists every
assumption):

1. Refine-and-Prune: unsupervised partitioning of requests into groups of homogeneous
   performance. Here: a one-dimensional regression tree on the last `window` finished
   requests, from their effective work x = ln(1 + predicted KV cost) to their measured service
   time y = ln(finish - admission). Refine splits, best first, a group whose spread of y
   exceeds `split` (at the x that removes the most variance); prune merges neighbours whose
   union is still that homogeneous, and groups too small to stand alone.
2. Dynamic queue routing: each arriving request goes to the FIFO queue of the group its x
   falls in. Edges are snapped to a grid of `edge_grid` in x, and a refit keeps the current
   edges unless the new ones explain the window materially better (`hysteresis`), so that
   noise does not reroute the queues; a real change reroutes every queued request.
3. Density-weighted scoring: the next request is the head of the group with the largest

       score_g = (wait of its head + tau) * (1 + phi * ln(1 + n_g)) * exp(-alpha * (y_g - y_all))

   where n_g is the number of requests waiting in the group (its density), y_g the group's
   mean log service time and y_all that of all groups (exp(y_g - y_all) is how much slower
   the group's requests are than the average). alpha weighs urgency (shorter groups first),
   phi the fairness of crowded groups, and the waiting time ages every head, so that no group
   starves.
4. Bayesian meta-optimisation: every `epoch` finished requests the measured score of the
   epoch, the mean of ln(1 + queueing delay / service time) over its requests (low when short
   requests do not wait behind long ones, without ignoring the long ones), goes to a Thompson
   sampling tuner over the grid of (alpha, phi, split), which proposes the next parameters.

Everything is deterministic given the seed, and cheap: a decision looks at the heads of at
most `max_groups` queues; a refit sorts `window` observations.

`EwsjfState` is the dispatcher's queue for this policy: it implements the `RequestQueue`
protocol of queues.py (push, peek, pop, remove), so the dispatcher admits from the group
queues exactly as it admits from the agent heap of the other policies (docs/architecture.md).
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import deque
from dataclasses import dataclass, field
from itertools import product
from typing import TYPE_CHECKING, Any

from .state import AgentState, GroupTicket, RequestState, RequestStatus, SchedulerContext

if TYPE_CHECKING:  # pragma: no cover
    from .tuner import GridThompsonTuner


@dataclass(frozen=True)
class EwsjfConfig:
    """EWSJF's constants and the grid its tuner searches."""

    window: int = 256  # finished requests the partition is fitted on
    first_fit: int = 32  # finished requests before the first partition (FIFO until then)
    epoch: int = 32  # finished requests between tuner steps and refits
    min_group: int = 12  # observations a group needs to be split off
    max_groups: int = 8
    edge_grid: float = 0.25  # edges are multiples of this, in ln(work)
    # A refit adopts new edges only if they explain the window's service times materially
    # better (squared error down by this fraction), or as well with fewer groups; otherwise
    # the current edges stay and only the groups' statistics are refreshed, so that noise in
    # the window does not reroute every queued request.
    hysteresis: float = 0.1
    # The tuner's grid: 16 points, few enough to converge within a few thousand requests.
    alphas: tuple[float, ...] = (1.0, 2.0, 4.0, 8.0)  # urgency: weight of the group's speed
    phis: tuple[float, ...] = (0.0, 0.5)  # density: weight of the group's queue length
    splits: tuple[float, ...] = (0.25, 0.5)  # homogeneity: max std of ln(service) in a group
    start: tuple[float, float, float] = (2.0, 0.0, 0.5)  # (alpha, phi, split) before tuning

    def grid(self) -> list[tuple[float, float, float]]:
        return list(product(self.alphas, self.phis, self.splits))


@dataclass(frozen=True)
class Partition:
    """Group edges in x (len = groups - 1) and each group's mean y (log service time)."""

    edges: tuple[float, ...] = ()
    means: tuple[float, ...] = (0.0,)
    spreads: tuple[float, ...] = (0.0,)  # standard deviation of y in each group
    sizes: tuple[int, ...] = (0,)  # observations in each group

    @property
    def sse(self) -> float:
        """Squared error of y around the group means: what the partition leaves unexplained."""
        return sum(n * s * s for n, s in zip(self.sizes, self.spreads, strict=True))

    def group(self, x: float) -> int:
        return bisect.bisect_right(self.edges, x)


def work_of(req: RequestState) -> float:
    """A request's effective work on the log scale EWSJF partitions: ln(1 + KV cost)."""
    return math.log1p(req.est_kv_cost)


# -- refine and prune -------------------------------------------------------------------
class _Sums:
    """Prefix sums of y and y^2 over observations sorted by x: O(1) variance of any range."""

    def __init__(self, ys: list[float]) -> None:
        self.s = [0.0]
        self.q = [0.0]
        for y in ys:
            self.s.append(self.s[-1] + y)
            self.q.append(self.q[-1] + y * y)

    def sse(self, lo: int, hi: int) -> float:
        n = hi - lo
        if n <= 0:
            return 0.0
        s = self.s[hi] - self.s[lo]
        return max(0.0, (self.q[hi] - self.q[lo]) - s * s / n)

    def mean(self, lo: int, hi: int) -> float:
        return (self.s[hi] - self.s[lo]) / max(1, hi - lo)

    def std(self, lo: int, hi: int) -> float:
        return math.sqrt(self.sse(lo, hi) / max(1, hi - lo))


def _best_split(xs: list[float], sums: _Sums, lo: int, hi: int, min_size: int) -> tuple[int, float] | None:
    """The split index k (groups [lo, k) and [k, hi)) between distinct x values that removes
    the most squared error, with at least `min_size` observations on each side."""
    best, gain = None, 0.0
    total = sums.sse(lo, hi)
    for k in range(lo + min_size, hi - min_size + 1):
        if xs[k - 1] == xs[k]:
            continue
        g = total - sums.sse(lo, k) - sums.sse(k, hi)
        if g > gain:
            best, gain = k, g
    return None if best is None else (best, gain)


def refine_and_prune(
    obs: list[tuple[float, float]], split: float, min_size: int, max_groups: int, edge_grid: float
) -> Partition:
    """Partition observations (x, y) into x-ranges whose y are homogeneous (std <= split).

    Refine: split, best first, the group with the largest spread of y while its std exceeds
    `split`, at the x that removes the most variance (each side keeps `min_size`
    observations), up to `max_groups`. Edges are snapped to multiples of `edge_grid`.
    Prune: merge neighbours whose union is still homogeneous, and groups left with fewer than
    `min_size` observations by the snapping, into the neighbour whose mean is closest.
    """
    if not obs:
        return Partition()
    pts = sorted(obs)
    xs = [x for x, _ in pts]
    ys = [y for _, y in pts]
    sums = _Sums(ys)
    # refine: leaves are index ranges; split the worst one while it is not homogeneous
    leaves = [(0, len(pts))]
    while len(leaves) < max_groups:
        cands = [(sums.sse(lo, hi), lo, hi) for lo, hi in leaves if sums.std(lo, hi) > split]
        split_done = False
        for _, lo, hi in sorted(cands, reverse=True):
            found = _best_split(xs, sums, lo, hi, min_size)
            if found is None:
                continue
            k = found[0]
            i = leaves.index((lo, hi))
            leaves[i:i + 1] = [(lo, k), (k, hi)]
            split_done = True
            break
        if not split_done:
            break
    # snap the edges to the grid and regroup the observations by the snapped edges
    edges = sorted({_snap((xs[lo - 1] + xs[lo]) / 2.0, edge_grid) for lo, _ in leaves[1:]})
    groups = _ranges(xs, edges)
    # prune: merge what cannot stand alone, then neighbours that are homogeneous together
    while edges and _prune_once(edges, groups, sums, split, min_size):
        pass
    return Partition(
        edges=tuple(edges),
        means=tuple(sums.mean(lo, hi) for lo, hi in groups),
        spreads=tuple(sums.std(lo, hi) for lo, hi in groups),
        sizes=tuple(hi - lo for lo, hi in groups),
    )


def _prune_once(edges: list[float], groups: list[tuple[int, int]], sums: _Sums, split: float, min_size: int) -> bool:
    """One merge (in place): a group with fewer than `min_size` observations joins the
    neighbour whose mean is closest; otherwise the neighbours whose union has the smallest
    spread merge if that spread is within `split`. False when nothing merges."""
    def merge(i: int) -> None:  # groups i and i + 1 become one; edge i goes
        del edges[i]
        groups[i:i + 2] = [(groups[i][0], groups[i + 1][1])]

    for i, (lo, hi) in enumerate(groups):
        if hi - lo < min_size:
            if i == 0 or hi == lo:
                merge(i if i + 1 < len(groups) else i - 1)
            elif i + 1 == len(groups):
                merge(i - 1)
            else:
                m = sums.mean(lo, hi)
                left = abs(sums.mean(*groups[i - 1]) - m)
                right = abs(sums.mean(*groups[i + 1]) - m)
                merge(i - 1 if left <= right else i)
            return True
    spreads = [(sums.std(groups[i][0], groups[i + 1][1]), i) for i in range(len(edges))]
    spread, i = min(spreads)
    if spread <= split:
        merge(i)
        return True
    return False


def partition_on(obs: list[tuple[float, float]], edges: tuple[float, ...]) -> Partition:
    """The statistics of the observations grouped by given edges."""
    pts = sorted(obs)
    xs = [x for x, _ in pts]
    sums = _Sums([y for _, y in pts])
    groups = _ranges(xs, list(edges))
    return Partition(
        edges=tuple(edges),
        means=tuple(sums.mean(lo, hi) for lo, hi in groups),
        spreads=tuple(sums.std(lo, hi) for lo, hi in groups),
        sizes=tuple(hi - lo for lo, hi in groups),
    )


def _snap(x: float, grid: float) -> float:
    return round(x / grid) * grid if grid > 0 else x


def _ranges(xs: list[float], edges: list[float]) -> list[tuple[int, int]]:
    """Index ranges of sorted xs cut at the edges (a value equal to an edge goes right)."""
    cuts = [0] + [bisect.bisect_left(xs, e) for e in edges] + [len(xs)]
    return [(cuts[i], cuts[i + 1]) for i in range(len(cuts) - 1)]


def ticket_of(req: RequestState) -> GroupTicket:
    """The ticket `EwsjfState.enqueue` gave a request (every request in its queues has one)."""
    if req.ticket is None:
        raise RuntimeError(f"request {req.spec.request_id!r} was never queued by EWSJF")
    return req.ticket


# -- the per-dispatcher state -------------------------------------------------------------
@dataclass
class EwsjfState:
    """Group queues, the partition, measured performance and the tuner of one dispatcher.

    The group queues are the dispatcher's `RequestQueue` for EWSJF (`attach` gives them the
    context they read tau from).
    """

    config: EwsjfConfig
    seed: int = 0
    partition: Partition = field(default_factory=Partition)
    queues: list[deque[RequestState]] = field(default_factory=lambda: [deque()])
    counts: list[int] = field(default_factory=lambda: [0])
    weights: list[float] = field(default_factory=lambda: [1.0])
    params: tuple[float, float, float] = (2.0, 0.0, 0.5)
    queued: int = 0
    finished: int = 0
    epochs: int = 0
    refits: int = 0
    reroutes: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)  # one entry per epoch: params, score
    _obs: deque[tuple[float, float]] = field(default_factory=deque)  # (work, ln service)
    _epoch_sum: float = 0.0
    _epoch_n: int = 0
    _tuner: GridThompsonTuner = field(init=False)  # made in __post_init__ (numpy is lazy)
    _grid: list[tuple[float, float, float]] = field(default_factory=list)
    _ctx: SchedulerContext | None = None

    def __post_init__(self) -> None:
        from .tuner import GridThompsonTuner  # numpy: only when EWSJF is used

        cfg = self.config
        self._obs = deque(maxlen=cfg.window)
        self._grid = cfg.grid()
        start = self._grid.index(cfg.start) if cfg.start in self._grid else 0
        self._tuner = GridThompsonTuner(self._grid, seed=self.seed, start=start)
        self.params = self._grid[start]
        self._set_weights()

    def attach(self, ctx: SchedulerContext) -> EwsjfState:
        """Serve as the queue of the dispatcher behind `ctx` (peek reads its tau)."""
        self._ctx = ctx
        return self

    @property
    def ctx(self) -> SchedulerContext:
        """The context `attach` gave (the queue is unusable before)."""
        if self._ctx is None:
            raise RuntimeError("EWSJF's queue is not attached to a dispatcher: call attach(ctx) first")
        return self._ctx

    # -- the RequestQueue protocol (queues.py) ------------------------------------------------
    def push(self, agent: AgentState, req: RequestState) -> None:
        self.enqueue(req)

    def peek(self, now: float) -> RequestState | None:
        return self.select(now, self.ctx.tau)

    def pop(self, agent: AgentState, req: RequestState) -> None:
        self.take(req)

    def remove(self, agent: AgentState, req: RequestState) -> None:
        self.drop(req)

    def remove_agent(self, agent: AgentState, pending: list[RequestState]) -> None:
        for req in pending:
            self.drop(req)

    def requeue(self, agent: AgentState) -> None:
        """Nothing to do: the order depends on requests and time, not on agents' keys."""

    def defer(self) -> bool:
        return False  # no backfill past the best-scoring head

    def restore(self) -> None:
        """Nothing was deferred."""

    def head(self, agent: AgentState) -> RequestState | None:
        return None  # the queues order requests, not agents

    def leader(self) -> AgentState | None:
        return None

    # -- routing --------------------------------------------------------------------------
    def enqueue(self, req: RequestState) -> None:
        g = self.partition.group(work_of(req))
        if req.ticket is None:
            req.ticket = GroupTicket(g)
        else:
            req.ticket.group = g
        self.queues[g].append(req)
        self.counts[g] += 1
        self.queued += 1

    def drop(self, req: RequestState) -> None:
        """A queued request leaves without being admitted (cancelled); lazy removal."""
        ticket = req.ticket
        if req.status is not RequestStatus.PENDING or ticket is None or ticket.group is None:
            return
        self.counts[ticket.group] -= 1
        self.queued -= 1
        ticket.group = None

    def _head(self, g: int) -> RequestState | None:
        q = self.queues[g]
        while q and ticket_of(q[0]).group is None:
            q.popleft()  # entries of requests dropped while queued
        return q[0] if q else None

    def select(self, now: float, tau: float) -> RequestState | None:
        """The head of the group with the largest density-weighted score."""
        if self.queued == 0:
            return None
        phi = self.params[1]
        best, best_score = None, -1.0
        for g, n in enumerate(self.counts):
            if n == 0:
                continue
            head = self._head(g)
            assert head is not None  # counts[g] > 0: a live request is still in the queue
            score = (now - head.submitted_at + tau) * self.weights[g] * (1.0 + phi * math.log1p(n))
            if score > best_score:  # ties: the shorter group (lower index) wins
                best, best_score = head, score
        return best

    def take(self, req: RequestState) -> None:
        """The selected head was admitted: pop it (its group index stays for priority)."""
        g = ticket_of(req).group
        if g is None or self._head(g) is not req:
            raise RuntimeError("EWSJF admitted a request that is not the head of its group")
        self.queues[g].popleft()
        self.counts[g] -= 1
        self.queued -= 1

    # -- measured performance, refits and tuning --------------------------------------------
    def observe(self, req: RequestState, now: float, tau: float) -> None:
        """A request finished: record its service time, maybe refit and tune."""
        admitted_at = req.ticket.admitted_at if req.ticket is not None else None
        if admitted_at is None:
            return
        service = max(now - admitted_at, tau)
        delay = max(0.0, admitted_at - req.submitted_at)
        self._obs.append((work_of(req), math.log(service)))
        self._epoch_sum += math.log1p(delay / service)
        self._epoch_n += 1
        self.finished += 1
        cfg = self.config
        if self.refits == 0 and self.finished >= cfg.first_fit:
            self.refit()
        elif self._epoch_n >= cfg.epoch:
            self._end_epoch()

    def _end_epoch(self) -> None:
        score = self._epoch_sum / max(1, self._epoch_n)
        idx = self._grid.index(self.params)
        self._tuner.observe(idx, score)
        self.history.append({"params": self.params, "score": score, "groups": len(self.counts)})
        self._epoch_sum, self._epoch_n = 0.0, 0
        self.epochs += 1
        self.params = self._grid[self._tuner.suggest()]
        self.refit()

    def refit(self) -> None:
        """Refine and prune on the observation window; reroute the queues if the edges moved."""
        cfg = self.config
        obs = list(self._obs)
        part = refine_and_prune(obs, self.params[2], cfg.min_group, cfg.max_groups, cfg.edge_grid)
        self.refits += 1
        old = self.partition.edges
        if part.edges != old:
            kept = partition_on(obs, old)
            sse_new, sse_old = part.sse, kept.sse
            fewer = len(part.edges) < len(old) and sse_new <= (1 + cfg.hysteresis) * sse_old
            if not (sse_new < (1 - cfg.hysteresis) * sse_old or fewer):
                part = kept  # not materially better: keep the groups the queues are in
        self.use_partition(part)

    def use_partition(self, part: Partition) -> None:
        """Route by `part` from now on: queued requests move to its groups where its edges
        differ from the current ones, and the groups' urgencies follow its means."""
        moved = part.edges != self.partition.edges
        self.partition = part
        if moved:
            self._reroute()
        self._set_weights()

    def _reroute(self) -> None:
        # every queue is in arrival (seq) order already: merge them instead of sorting
        live = [r for r in heapq.merge(*self.queues, key=lambda r: r.seq) if ticket_of(r).group is not None]
        n = len(self.partition.means)
        self.queues = [deque() for _ in range(n)]
        self.counts = [0] * n
        self.queued = 0
        for r in live:
            self.enqueue(r)
        self.reroutes += 1

    def _set_weights(self) -> None:
        """exp(-alpha * (y_g - y_all)): urgency of each group, relative to the average."""
        part = self.partition
        total = sum(part.sizes)
        y_all = sum(m * s for m, s in zip(part.means, part.sizes, strict=True)) / total if total else 0.0
        alpha = self.params[0]
        self.weights = [math.exp(-alpha * (m - y_all)) for m in part.means]

    def describe(self) -> dict[str, Any]:
        alpha, phi, split = self.params
        best = self._grid[self._tuner.best()]
        return {
            "groups": len(self.partition.means),
            "edges_ln_work": list(self.partition.edges),
            "group_mean_service_s": [math.exp(m) for m in self.partition.means],
            "params": {"alpha": alpha, "phi": phi, "split": split},
            "believed_best": {"alpha": best[0], "phi": best[1], "split": best[2]},
            "epochs": self.epochs,
            "refits": self.refits,
            "reroutes": self.reroutes,
        }
