"""Engine backends behind one interface (see `server.engine.base`)."""

from server.engine.base import (
    Engine,
    EngineError,
    EngineInfo,
    EngineOutput,
    EngineRequest,
    EngineStats,
    InvalidRequestError,
    SamplingOptions,
)

__all__ = [
    "Engine",
    "EngineError",
    "EngineInfo",
    "EngineOutput",
    "EngineRequest",
    "EngineStats",
    "InvalidRequestError",
    "SamplingOptions",
]
