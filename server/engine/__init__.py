"""Engine backends behind one interface (see `server.engine.base`)."""

from server.engine.base import (
    Capabilities,
    CapacityChanges,
    Engine,
    EngineError,
    EngineInfo,
    EngineOutput,
    EngineRequest,
    EngineStats,
    InvalidRequestError,
    Placement,
    ReplicaList,
    SamplingOptions,
    StepStatistics,
    Supervised,
)

__all__ = [
    "Capabilities",
    "CapacityChanges",
    "Engine",
    "EngineError",
    "EngineInfo",
    "EngineOutput",
    "EngineRequest",
    "EngineStats",
    "InvalidRequestError",
    "Placement",
    "ReplicaList",
    "SamplingOptions",
    "StepStatistics",
    "Supervised",
]
