"""A server of its own on the real engine with a trained cost predictor: its announcement
in the log and the records that name it. The agent API's contract suite, on the fake engine
and on vLLM, is tests/api/test_agents_api.py."""

from __future__ import annotations

import httpx
import pytest

from tests.support.agents import register
from tests.support.servers import ENGINE_KV_TOKENS


@pytest.fixture(scope="module")
def predictor_server(tmp_path_factory: pytest.TempPathFactory, justitia_home: str):
    """A server of its own with one trained predictor (fact_verification)."""
    from justitia_cli import main
    from predictors.samples import write_samples
    from predictors.synthetic import synthesize
    from server.launcher import EmbeddedServer
    from tests.support.servers import ENGINE_MAX_MODEL_LEN

    root = tmp_path_factory.mktemp("predictor-server")
    write_samples(synthesize("fact_verification", 50, seed=1), root / "samples.jsonl")
    models = root / "models"
    assert main(["train-predictor", "fact_verification", "--samples", str(root / "samples.jsonl"),
                 "--out", str(models / "fv"), "--quiet"]) == 0
    args = ["--kv-tokens", str(ENGINE_KV_TOKENS), "--max-model-len", str(ENGINE_MAX_MODEL_LEN),
            "--predictors", str(models), "--data-dir", str(root / "data")]
    with EmbeddedServer(args, env={"JUSTITIA_HOME": justitia_home}) as srv:
        yield srv, models / "fv"


def test_trained_predictor_is_announced_and_named_in_the_record(predictor_server) -> None:
    from predictors import load_predictor
    from predictors.synthetic import synthesize

    srv, model_dir = predictor_server
    predictor = load_predictor(model_dir)
    # the model cross-validation chose is the one announced
    assert (f"cost predictor for 'fact_verification': {predictor.metadata['model']}, 50 samples "
            f"(40 train / 10 held out), {model_dir}") in srv.log_path.read_text()
    sample = synthesize("fact_verification", 1, seed=7)[0]
    with httpx.Client(base_url=srv.url, timeout=60.0) as c:
        # Numeric features travel in metadata["features"] (docs/predictors.md).
        rec = register(c, type_="fact_verification", prompt=sample.prompt,
                       metadata={"features": sample.features})
        plain = register(c, type_="fact_verification", prompt=sample.prompt)
        other = register(c, type_="not_trained", prompt=sample.prompt)
        for r in (rec, plain, other):
            c.delete(f"/v1/agents/{r['id']}")
    assert rec["cost_source"] == plain["cost_source"] == "model"
    assert rec["predicted_cost"] == pytest.approx(predictor.predict(sample.prompt, sample.features), rel=1e-6)
    assert plain["predicted_cost"] == pytest.approx(predictor.predict(sample.prompt, None), rel=1e-6)
    assert rec["predicted_cost"] != pytest.approx(plain["predicted_cost"], rel=1e-3)
    assert other["cost_source"] == "cold_start"
    _features_from_the_sdk(srv.url, sample.prompt, sample.features, predictor)


def _features_from_the_sdk(url: str, prompt: str, features: dict, predictor) -> None:
    """The SDK route of docs/predictors.md: `invoke(..., metadata={"features": ...})`."""
    import anyio

    from justitia_sdk import AsyncClient, agent, llm

    @agent("fact_verification", prompt=lambda claim: claim)
    async def verify(claim: str) -> str:
        return await llm(claim[:200], max_tokens=2)

    records = []

    async def go() -> None:
        async with AsyncClient(url) as client:
            await verify.invoke([prompt], metadata={"features": features}, client=client,
                                on_start=lambda run: records.append(run.record))

    anyio.run(go)
    assert records[0].cost_source == "model"
    assert records[0].predicted_cost == pytest.approx(predictor.predict(prompt, features), rel=1e-6)
