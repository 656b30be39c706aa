"""Engine backends behind one interface (see `server.engine.base`)."""

from server.engine.base import (
    Autoscaled,
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
    "Autoscaled",
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
