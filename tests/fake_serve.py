"""`justitia serve` on the fake engine, in a process of its own: the fast tier's way to test
what only a whole server process does (signals, its exit, its child processes).

    python -m tests.fake_serve --port P --data-dir DIR [--shutdown-grace-s S] [--health-port H]
        [--step-s S] [--retrain-every N]

It runs `server.cli.serve`, the function `justitia serve` runs, with a `FakeEngine`.
"""

from __future__ import annotations

import argparse
import sys

from server.api.config import ServerConfig
from server.cli import serve
from tests.fake_engine import FakeEngine


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--shutdown-grace-s", type=float, default=10.0)
    parser.add_argument("--health-port", type=int, default=None)
    parser.add_argument("--step-s", type=float, default=None, help="the fake engine's step time")
    parser.add_argument("--retrain-every", type=int, default=0)
    args = parser.parse_args(argv)
    engine = FakeEngine(**({"step_s": args.step_s} if args.step_s is not None else {}))
    config = ServerConfig(port=args.port, data_dir=args.data_dir, health_port=args.health_port,
                          shutdown_grace_s=args.shutdown_grace_s, retrain_every=args.retrain_every,
                          log_level="info")
    return serve(config, engine=engine)


if __name__ == "__main__":
    sys.exit(main())
