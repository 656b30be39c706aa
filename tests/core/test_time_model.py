"""The engine's step-time model and its fitter (server/scheduler/time_model.py), the profile
file of `bench calibrate` and `--profile FILE`, and the ETA/promise fields of `bench sim`."""

import json
import random

import pytest

from justitia_cli import main
from server.scheduler.time_model import (
    DEFAULT_PRIOR,
    StepSample,
    TimeModel,
    TimeModelBank,
    TimeModelFitter,
    fit_samples,
)
from server.shared.profiles import PROFILES, EngineProfile, load_profile
from server.sim.calibrate import save_profile
from server.sim.mix import make_mix
from server.sim.workload import save_workload

TRUE = TimeModel(0.004, 0.00008, 0.00003, 0.0000004)


def _samples(model: TimeModel, n: int, rng: random.Random, noise: float = 0.15) -> list[StepSample]:
    out = []
    for _ in range(n):
        seqs = rng.randint(1, 96)
        prefill = rng.choice([0, 0, 0, rng.randint(16, 4000)])
        kv = rng.randint(0, 16000)
        y = model.step_s(seqs, prefill, kv) * max(0.05, 1.0 + rng.gauss(0.0, noise))
        out.append(StepSample(y, seqs, prefill, kv))
    return out


def test_fitter_recovers_known_coefficients_from_noisy_steps() -> None:
    fitter = TimeModelFitter(DEFAULT_PRIOR, decay=0.9995)
    for s in _samples(TRUE, 4000, random.Random(3)):
        fitter.observe(s)
    m = fitter.refit()
    for got, want in zip(m.coefficients, TRUE.coefficients, strict=True):
        assert got == pytest.approx(want, rel=0.15)
    assert m.samples == 4000
    assert m.error_p50 is not None and m.error_p50 < 0.2  # the noise is 15%
    assert abs(m.total_error) < 0.05  # the sum of step times is right


def test_fit_is_never_negative_even_when_noise_pulls_a_term_below_zero() -> None:
    # Steps whose time does not grow with the KV held, measured with noise correlated to KV:
    # plain least squares gives the KV term a negative coefficient.
    rng = random.Random(5)
    samples = []
    for _ in range(500):
        seqs, kv = rng.randint(1, 64), rng.randint(0, 16000)
        y = 0.003 + 0.0001 * seqs - 0.0000001 * kv + rng.gauss(0, 0.0002)
        samples.append(StepSample(max(y, 1e-4), seqs, 0, kv))
    m = fit_samples(samples, DEFAULT_PRIOR, prior_weight=0.0)
    assert all(c >= 0.0 for c in m.coefficients)
    assert m.per_kv_token_s == 0.0
    assert m.per_seq_s > 0.0


def test_without_samples_the_fit_is_the_prior_and_a_term_never_exercised_stays_near_it() -> None:
    fitter = TimeModelFitter(DEFAULT_PRIOR)
    assert fitter.refit().coefficients == pytest.approx(DEFAULT_PRIOR.coefficients)
    rng = random.Random(1)
    for _ in range(300):  # decode-only steps: no prefill ever seen
        seqs = rng.randint(1, 32)
        fitter.observe(StepSample(TRUE.step_s(seqs, 0, 2000), seqs, 0, 2000))
    m = fitter.refit()
    assert m.per_prefill_token_s == pytest.approx(DEFAULT_PRIOR.per_prefill_token_s, rel=0.05)


def test_recency_weighting_follows_an_engine_that_slows_down() -> None:
    rng = random.Random(7)
    slow = TimeModel(*(2.0 * c for c in TRUE.coefficients))
    decayed = TimeModelFitter(DEFAULT_PRIOR, decay=0.995)
    flat = TimeModelFitter(DEFAULT_PRIOR, decay=1.0)
    for s in _samples(TRUE, 2000, rng, noise=0.05) + _samples(slow, 1000, rng, noise=0.05):
        decayed.observe(s)
        flat.observe(s)
    probe = (32, 512, 8000)
    want = slow.step_s(*probe)
    assert decayed.refit().step_s(*probe) == pytest.approx(want, rel=0.1)
    assert flat.refit().step_s(*probe) < 0.85 * want  # remembers the fast engine


def test_bank_keeps_one_model_per_engine() -> None:
    bank = TimeModelBank(DEFAULT_PRIOR, refit_every=1)
    fast, slow = TimeModel(0.002, 0.0, 0.0, 0.0), TimeModel(0.02, 0.0, 0.0, 0.0)
    for i in range(1000):
        seqs = 1 + i % 8
        bank.observe("a", StepSample(fast.step_s(seqs, 0, 0), seqs, 0, 0))
        bank.observe("b", StepSample(slow.step_s(seqs, 0, 0), seqs, 0, 0))
    models = bank.models()
    assert models["a"].step_s(4, 0, 0) == pytest.approx(0.002, rel=0.05)
    assert models["b"].step_s(4, 0, 0) == pytest.approx(0.02, rel=0.05)
    assert set(bank.describe()["engines"]) == {"a", "b"}


def test_profile_file_round_trip_and_bad_files(tmp_path) -> None:
    prof = EngineProfile("mine", 4096, 256, 4096, 0.003, 0.00007, 0.00002, 0.0000001, 0.25, "test")
    path = tmp_path / "p.json"
    save_profile(prof, path, fit={"error_p50": 0.1}, settings={"kv_tokens": 4096})
    assert load_profile(str(path)) == prof
    assert load_profile("cpu-tiny") is PROFILES["cpu-tiny"]
    (tmp_path / "bad.json").write_text('{"profile": {}}')
    with pytest.raises(ValueError, match="not an engine profile"):
        load_profile(str(tmp_path / "bad.json"))
    doc = json.loads(path.read_text())
    doc["profile"]["per_seq_s"] = -1
    (tmp_path / "neg.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="per_seq_s"):
        load_profile(str(tmp_path / "neg.json"))
    with pytest.raises(ValueError, match="unknown profile"):
        load_profile(str(tmp_path / "missing.json"))


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    path = tmp_path_factory.mktemp("wl") / "w.jsonl"
    save_workload(make_mix(30, PROFILES["cpu-tiny"], kv_tokens=8192, seed=2, density=2), path)
    return path


def test_bench_sim_takes_a_profile_file_and_reports_etas_and_promises(workload, tmp_path) -> None:
    base = PROFILES["cpu-tiny"]
    slow = EngineProfile(**{**base.as_dict(), "name": "slow", "base_s": 4 * base.base_s,
                            "per_seq_s": 4 * base.per_seq_s, "per_prefill_token_s": 4 * base.per_prefill_token_s})
    prof_path = tmp_path / "slow.json"
    save_profile(slow, prof_path)
    outs = {}
    for name, prof in (("builtin", "cpu-tiny"), ("file", str(prof_path))):
        out = tmp_path / f"{name}.json"
        assert main(["bench", "sim", "--workload", str(workload), "--policies", "fcfs,justitia",
                     "--kv-tokens", "8192", "--profile", prof, "--json", str(out), "--quiet"]) == 0
        outs[name] = json.loads(out.read_text())
    assert outs["file"]["config"]["profile"]["name"] == "slow"
    for doc in outs.values():
        for r in doc["results"]:
            assert {"eta_error_p50", "eta_error_p90", "promises_kept"} <= set(r)
            errs = []
            for a in r["agents"]:
                # the promise is never earlier than the forecast (a calibrated multiple of it,
                # capped by the worst case), and the forecast's interval holds the forecast
                assert a["first_eta_s"] > 0
                assert a["first_deadline_s"] >= a["first_eta_s"] - 1e-6, a
                low, high = a["first_eta_interval_s"]
                assert 0 < low <= a["first_eta_s"] <= high, a
                errs.append(abs(a["first_eta_s"] - a["jct_s"]) / a["jct_s"])
            errs.sort()
            assert r["eta_error_p50"] == pytest.approx(errs[len(errs) // 2], rel=0.5)
            assert 0 <= r["promises_kept"] <= len(r["agents"])
            assert r["promises_kept"] == sum(a["jct_s"] <= a["first_deadline_s"] + 1e-6 for a in r["agents"])
    # a four times slower engine: longer JCTs with the file than with the built-in profile
    mean = lambda d: d["results"][0]["mean_jct_s"]  # noqa: E731
    assert mean(outs["file"]) > 2 * mean(outs["builtin"])


def test_bench_sim_refuses_a_bad_profile_file(workload, tmp_path, capsys) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    rc = main(["bench", "sim", "--workload", str(workload), "--profile", str(bad), "--quiet"])
    assert rc != 0
    assert "cannot read the profile file" in capsys.readouterr().err


def test_calibration_measures_the_engine_the_server_runs(tmp_path, monkeypatch) -> None:
    # `bench calibrate` once left the dtype to vLLM, which runs a float32 model in bfloat16
    # on a CPU: on one without native bfloat16 it timed prefill 2x slower than the server's
    # float32 engine, and the simulator predicted the live run 40-50% too slow.
    from server.api.app import build_engine
    from server.api.config import ServerConfig
    from server.engine.vllm_local import LocalVLLMEngine
    from server.sim.calibrate import calibration_engine_config

    monkeypatch.setenv("JUSTITIA_HOME", str(tmp_path))  # the embedded model is made there
    served, _ = build_engine(ServerConfig(kv_tokens=4096, max_model_len=4096))
    assert isinstance(served, LocalVLLMEngine)
    measured = calibration_engine_config(4096, 4096)
    assert measured.dtype == "float32"
    for name in ("model", "dtype", "dummy_weights", "kv_tokens", "max_model_len", "max_num_seqs", "block_size",
                 "kv_cache_space_gib", "engine_core_nice"):
        assert getattr(measured, name) == getattr(served.config, name), name
    assert measured.restarts == 0  # a calibration whose engine dies says so instead of measuring another


def test_the_bank_also_fits_every_step_since_the_start() -> None:
    """The recency-weighted model is the engine as it runs now; a record of a whole run
    needs the fit to all of it (the model at a run's end is its last steps' engine)."""
    from justitia_cli.bench.sim import fitted_profile

    bank = TimeModelBank(DEFAULT_PRIOR, refit_every=100)
    slow, fast = TimeModel(0.006, 0.0, 0.0, 0.0), TimeModel(0.002, 0.0, 0.0, 0.0)
    for engine in (slow, fast):  # the engine speeds up half-way through the run
        for i in range(3000):
            seqs = 1 + i % 8
            bank.observe("local", StepSample(engine.step_s(seqs, 0, 0), seqs, 0, 0))
    now = bank.models()["local"].step_s(4, 0, 0)
    whole = bank.describe()["since_start"]["local"]
    assert now < 0.0025  # the last few thousand steps' engine
    assert whole["samples"] == 6000
    assert TimeModel(whole["base_s"], whole["per_seq_s"], whole["per_prefill_token_s"],
                     whole["per_kv_token_s"]).step_s(4, 0, 0) == pytest.approx(0.004, rel=0.05)
    # `bench live` simulates a run with the fit to all of it
    prof = fitted_profile(PROFILES["cpu-tiny"], bank.describe())
    assert prof is not None and prof.iteration_s(4, 0, 0) == pytest.approx(0.004, rel=0.05)
