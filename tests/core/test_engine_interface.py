"""The engine interface (server/engine/base.py): what every engine offers, the optional
capabilities each one has (found once, by `Capabilities.of`), and the guards they share.
No engine is started here: the engines are only built."""

from __future__ import annotations

import inspect

import pytest

from server.engine.base import (
    Capabilities,
    CapacityChanges,
    Engine,
    EngineError,
    EngineInfo,
    EngineRequest,
    InvalidRequestError,
    Placement,
    ReplicaList,
    SamplingOptions,
    StepSamples,
    StepStatistics,
    Supervised,
    check_request,
)
from server.engine.remote import RemoteVLLMEngine
from server.engine.vllm_local import LocalEngineConfig, LocalVLLMEngine
from tests.support.fake_engine import FakeEngine, SupervisedFakeEngine

# The members of `Engine`, read off the protocol itself so that this test follows it.
ENGINE_MEMBERS = sorted(
    name for name in vars(Engine)
    if not name.startswith("_") and name not in ("__init__",)
)


def local() -> LocalVLLMEngine:
    return LocalVLLMEngine(LocalEngineConfig(model="unused"))


def remote() -> RemoteVLLMEngine:
    return RemoteVLLMEngine("http://127.0.0.1:9")


@pytest.mark.parametrize("make", [local, remote, FakeEngine], ids=["local", "remote", "fake"])
def test_every_engine_has_the_whole_interface(make) -> None:
    engine = make()
    assert set(ENGINE_MEMBERS) >= {"info", "healthy", "start", "close", "tokenize",
                                   "apply_chat_template", "generate", "abort", "stats"}
    for name in ENGINE_MEMBERS:
        assert hasattr(type(engine), name), f"{type(engine).__name__} has no {name}"
    # The cancellation contract needs an async generator: closing it runs the cleanup now.
    assert inspect.isasyncgenfunction(type(engine).generate)
    # (`start` is not checked: the fast tier replaces LocalVLLMEngine.start with a refusal.)
    for name in ("close", "abort"):
        assert inspect.iscoroutinefunction(getattr(type(engine), name))


@pytest.mark.parametrize("make, expected", [
    (local, {"step_statistics", "step_samples", "supervision"}),
    (remote, {"step_statistics", "placement", "capacity_changes", "replicas"}),
    (FakeEngine, {"step_statistics", "step_samples"}),
    (SupervisedFakeEngine, {"step_statistics", "step_samples", "supervision"}),
    (object, set()),
], ids=["local", "remote", "fake", "supervised-fake", "bare"])
def test_each_engine_declares_its_capabilities(make, expected) -> None:
    engine = make()
    caps = Capabilities.of(engine)
    assert caps.names == expected
    protocols = {"step_statistics": StepStatistics, "step_samples": StepSamples,
                 "placement": Placement,
                 "capacity_changes": CapacityChanges, "replicas": ReplicaList,
                 "supervision": Supervised}
    for name, protocol in protocols.items():
        assert (getattr(caps, name) is engine) == (name in expected)
        assert isinstance(engine, protocol) == (name in expected)


def test_a_partial_capability_is_not_one() -> None:
    """`place` without `release` would leak reservations: it is not `Placement`."""

    class HalfPlaced:
        def place(self, request_id: str, agent_id: str, footprint: int) -> bool:
            return True

    assert Capabilities.of(HalfPlaced()).placement is None


@pytest.mark.parametrize("make", [local, remote, FakeEngine], ids=["local", "remote", "fake"])
def test_an_engine_not_started_says_so_and_has_no_template(make) -> None:
    engine = make()
    with pytest.raises(EngineError, match="has not started"):
        engine.info  # noqa: B018
    with pytest.raises(EngineError, match="has not started"):
        engine.tokenize("hello")
    assert engine.apply_chat_template([{"role": "user", "content": "hi"}]) is None
    assert not engine.healthy


def test_the_shared_request_guards_refuse_what_vllm_refuses() -> None:
    info = EngineInfo(model="m", kv_capacity_tokens=4096, block_size=32, max_model_len=512, vocab_size=300)

    def refused(ids: tuple[int, ...], **sampling: int) -> InvalidRequestError:
        with pytest.raises(InvalidRequestError) as caught:
            check_request(EngineRequest("r", ids, SamplingOptions(**sampling)), info)
        return caught.value

    assert "vocabulary (0 to 299)" in str(refused((1, 300)))
    too_long = refused((5,) * 500, max_tokens=20)
    assert too_long.param == "max_tokens" and "512 tokens" in str(too_long)
    assert refused((5,), max_tokens=2, min_tokens=3).param == "min_tokens"
    assert "empty" in str(refused(()))
    assert refused((5,), max_tokens=0).param == "max_tokens"
    check_request(EngineRequest("ok", (5,) * 400, SamplingOptions(max_tokens=112)), info)


def test_a_cpu_engine_warms_every_batch_size_it_can_hold() -> None:
    from server.engine.vllm_local import warm_batch_sizes

    assert warm_batch_sizes(256, 64) == list(range(1, 65))  # one block per sequence at least
    assert warm_batch_sizes(8, 64) == list(range(1, 9))  # no more than max_num_seqs
    assert warm_batch_sizes(256, 0) == []
