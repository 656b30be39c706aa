"""Online learning of cost predictors (fast tier): the swap rules of `OnlineTrainer`, and on
the FakeEngine server `GET /v1/predictors`, a new agent type learned from the agents it
served, and `train-predictor --from-history` reading the server's history file.

The engine-tier twin (test_predictors_engine.py) serves the same new type on vLLM.
"""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from predictors import PredictorRegistry
from predictors.online import OnlineTrainer
from predictors.synthetic import synthesize
from tests.support.agents import complete, register
from tests.support.clients import local_client
from tests.support.fake_engine import FakeServer
from tests.support.waiting import all_agents, wait_until
from tests.support.workloads import learn_new_type, predictor_row

# -- the swap rules, in process ---------------------------------------------------------------


@pytest.fixture()
def trainer() -> Iterator[OnlineTrainer]:
    # Jobs run in a thread here (the server uses one spawned process): same code, no spawn.
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    yield OnlineTrainer(retrain_every=20, executor=pool)
    pool.shutdown(wait=True)


def _feed(trainer: OnlineTrainer, rows, served, tenant: str = "t1") -> None:
    for s, pred in zip(rows, served, strict=True):
        trainer.observe(s.agent_type, tenant, s.prompt, s.cost, pred, s.features)


@pytest.mark.slow
def test_a_model_better_than_the_served_predictions_is_swapped_in(trainer: OnlineTrainer) -> None:
    rows = synthesize("fan_out_research", 40, seed=11)
    registry = PredictorRegistry(None, online=trainer)
    # what was served: a per-type constant, far off for the wide and the narrow fan-outs
    _feed(trainer, rows, [float(np.median([s.cost for s in rows]))] * len(rows))
    trainer.wait(60)
    [row] = trainer.describe()
    # one or two jobs: the one queued at the 20th sample is replaced if still waiting at the 40th
    assert row["samples"] == 40 and row["retrains"] in (1, 2) and row["swaps"] >= 1, row
    assert row["kind"] in ("ridge", "mlp") and row["last_trained"] is not None
    assert row["last_decision"].startswith("swapped in")
    served = registry.get("fan_out_research", "t1")
    assert served.metadata["source"] == "online"
    # it learned the declared fan-out: a wider agent is predicted to cost more
    assert served.predict(rows[0].prompt, {"fan_out": 12}) > 2 * served.predict(rows[0].prompt, {"fan_out": 2})
    # another tenant's agents of the same type are not predicted by it
    assert registry.get("fan_out_research", "t2").is_cold_start


@pytest.mark.slow
def test_no_swap_when_the_served_predictions_were_better(trainer: OnlineTrainer) -> None:
    rows = synthesize("react_loop", 40, seed=12)
    registry = PredictorRegistry(None, online=trainer)
    _feed(trainer, rows, [s.cost for s in rows])  # served exactly: nothing can beat that
    trainer.wait(60)
    [row] = registry.describe()
    assert row["retrains"] in (1, 2) and row["swaps"] == 0, row
    assert row["last_decision"].startswith("kept the served model")
    assert row["kind"] == "cold_start" and row["source"] == "online"  # what still serves
    assert row["recent_error"]["median_relative_error"] == 0.0
    assert trainer.get("react_loop", "t1") is None


def test_retraining_waits_for_enough_new_samples(trainer: OnlineTrainer) -> None:
    rows = synthesize("react_loop", 19, seed=13)
    _feed(trainer, rows, [1.0] * len(rows))
    trainer.wait(60)
    [row] = trainer.describe()
    assert row["retrains"] == 0 and not row["training"] and row["last_trained"] is None
    children = set(multiprocessing.active_children())
    off = OnlineTrainer(retrain_every=0)
    _feed(off, synthesize("react_loop", 25, seed=13), [1.0] * 25)
    assert off.describe() == []  # off: nothing kept, no process started
    assert set(multiprocessing.active_children()) <= children


def test_a_failed_job_keeps_the_served_model(trainer: OnlineTrainer, monkeypatch: pytest.MonkeyPatch) -> None:
    import predictors.online as online

    def boom(*args: object, **kwargs: object) -> dict:
        raise RuntimeError("boom")

    rows = synthesize("fan_out_research", 40, seed=14)
    monkeypatch.setattr(online, "train_job", boom)
    _feed(trainer, rows[:20], [1.0] * 20)
    trainer.wait(60)
    [row] = trainer.describe()
    assert row["last_decision"] == "failed: RuntimeError: boom" and not row["training"]
    assert row["retrains"] == 0 and trainer.get("fan_out_research", "t1") is None
    monkeypatch.undo()  # the next job works again
    _feed(trainer, rows[20:], [1.0] * 20)
    trainer.wait(60)
    [row] = trainer.describe()
    assert row["retrains"] == 1 and row["swaps"] == 1, row


# -- over HTTP on the fake engine -------------------------------------------------------------

ADMIN, USER = "admin-key", "user-key"


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeServer]:
    with FakeServer(tmp_path_factory.mktemp("pred-keys"),
                    api_keys={ADMIN: "admin", USER: "alice"}) as srv:
        yield srv


def test_predictors_endpoint_is_for_the_admin(keyed: FakeServer) -> None:
    assert httpx.get(keyed.url + "/v1/predictors").status_code == 401
    r = httpx.get(keyed.url + "/v1/predictors", headers={"Authorization": f"Bearer {USER}"})
    assert r.status_code == 403 and "admin" in r.json()["detail"]
    r = httpx.get(keyed.url + "/v1/predictors", headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200 and r.json() == {"retrain_every": 20, "predictors": []}


@pytest.mark.slow
def test_a_new_type_is_learned_from_the_agents_it_served(tmp_path: Path) -> None:
    with FakeServer(tmp_path) as srv, local_client(base_url=srv.url, timeout=30) as client:
        out = learn_new_type(client, "lookup_or_survey")
        row = predictor_row(client, "lookup_or_survey")
    print("online learning on the fake engine:", out)
    assert out["median_relative_error"] <= 0.30, (out, row)
    assert row is not None and row["samples"] == 50 and row["tenant"] == "default"
    assert row["recent_error"]["n"] == 20 and row["last_trained"]
    # the history keeps what train-predictor needs; --from-history FILE trains from it
    from justitia_cli import main

    model = tmp_path / "model"
    history = tmp_path / "history.sqlite3"
    assert main(["train-predictor", "lookup_or_survey", "--from-history", str(history),
                 "--out", str(model), "--quiet"]) == 0
    meta = json.loads((model / "metadata.json").read_text())
    assert meta["sample_count"] == 50 and meta["kind"] in ("median", "ridge", "mlp")
    assert meta["source"] == f"history {history}"


def test_history_samples_carry_the_declared_features(tmp_path: Path) -> None:
    with FakeServer(tmp_path, retrain_every=0) as srv, local_client(base_url=srv.url, timeout=30) as c:
        agent = register(c, type_="fan", prompt="three ways", metadata={"fan_out": 3, "stages": 2,
                                                                         "features": {"n_items": 5}})
        assert complete(c, agent["id"], 3).status_code == 200
        assert c.post(f"/v1/agents/{agent['id']}/finish").status_code == 200
        [sample] = c.get("/v1/history", params={"agent_type": "fan"}).json()["samples"]
        assert c.get("/v1/predictors").json() == {"retrain_every": 0, "predictors": []}
    assert sample["features"]["fan_out"] == 3 and sample["features"]["stages"] == 2
    assert sample["features"]["n_items"] == 5 and sample["features"]["n_requests"] == 1


def test_from_history_names_what_is_wrong(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from justitia_cli import main

    assert main(["train-predictor", "x", "--from-history", str(tmp_path / "nope.sqlite3"),
                 "--out", str(tmp_path / "m")]) == 2
    assert "no such file" in capsys.readouterr().err
    (tmp_path / "junk.sqlite3").write_text("not a database")
    assert main(["train-predictor", "x", "--from-history", str(tmp_path / "junk.sqlite3"),
                 "--out", str(tmp_path / "m")]) == 2
    assert "not a readable Justitia history" in capsys.readouterr().err


def test_serve_refuses_a_negative_retrain_every(capsys: pytest.CaptureFixture[str]) -> None:
    from justitia_cli import main

    assert main(["serve", "--retrain-every", "-1"]) == 2  # refused before any engine starts
    assert "--retrain-every takes a count of agents >= 0" in capsys.readouterr().err


def test_followed_types_are_bounded(trainer: OnlineTrainer, monkeypatch: pytest.MonkeyPatch) -> None:
    import predictors.online as online

    monkeypatch.setattr(online, "MAX_KEYS", 3)
    for k in range(5):
        trainer.observe(f"type{k}", "t1", "a prompt", 10.0, 5.0)
    assert [r["agent_type"] for r in trainer.describe()] == ["type0", "type1", "type2"]


def test_an_untagged_request_does_not_set_the_cold_starts_output_length(tmp_path: Path) -> None:
    """`make demo` sends one untagged 8-token request to warm the engine up: taken as an
    agent, it would become the output length per request the cold start assumes for every
    type not seen yet, and make the first predictions (and first ETAs) 40-200x too small."""
    prompt = "Summarize the following report in three parts, one per section. " * 10
    with FakeServer(tmp_path) as srv, local_client(base_url=srv.url, timeout=30) as client:
        before = register(client, "never_seen_a", prompt)["predicted_cost"]
        assert complete(client, None, 8).status_code == 200
        # the untagged request's agent: the listeners hear of its end as it is recorded finished
        wait_until(lambda: [a["state"] for a in all_agents(client) if a["cost_source"] == "request"] == ["finished"])
        after = register(client, "never_seen_b", prompt)["predicted_cost"]
    assert after == pytest.approx(before)  # the default output length, unchanged


@pytest.mark.slow
def test_three_tiny_agents_do_not_poison_an_unseen_types_cold_start(tmp_path: Path) -> None:
    """Three 8-token agents run just before a batch set the output length assumed for every
    type not seen yet: agents of another type that went on to use 79k-115k were predicted
    156-292. The unseen type's prediction comes from its own prompt and declared shape, and
    its interval allows for a guess."""
    prompt = "Research the history of the river and write a report on each town. " * 6
    shape = {"stages": 3, "fan_out": 5, "features": {"max_tokens": 512}}
    with FakeServer(tmp_path) as srv, local_client(base_url=srv.url, timeout=30) as client:
        before = register(client, "researcher_a", prompt, metadata=shape)
        for _ in range(3):
            tiny = register(client, "warm_up", "hi")
            assert complete(client, tiny["id"], 8, prompt="hi").status_code == 200
            assert client.post(f"/v1/agents/{tiny['id']}/finish").status_code == 200
        wait_until(lambda: len([a for a in all_agents(client)
                                if a["type"] == "warm_up" and a["state"] == "finished"]) == 3)
        after = register(client, "researcher_b", prompt, metadata=shape)
        plain = register(client, "researcher_c", prompt)
    assert after["cost_source"] == "cold_start"
    assert after["predicted_cost"] == pytest.approx(before["predicted_cost"])
    # what the declared shape implies: 15 requests of the prompt and 512 output tokens each
    assert after["predicted_cost"] > 15 * 512 * 512 / 2
    # undeclared: one request of 256 output tokens, not of the warm-up's 8
    assert plain["predicted_cost"] > 256 * 256 / 2
    assert after["predicted_cost_p90"] > 3 * after["predicted_cost"]
