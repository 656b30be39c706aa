"""`justitia serve` on the fake engine, in a process of its own: the fast tier's way to test
what only a whole server process does (signals, its exit, its child processes).

    python -m tests.support.fake_serve --port P --data-dir DIR [--shutdown-grace-s S] [--health-port H]
        [--step-s S] [--retrain-every N] [--max-restarts N --restart-delay-s S]

It runs `server.cli.serving.serve`, the function `justitia serve` runs, with a `FakeEngine`; with
--max-restarts, a `SupervisedFakeEngine` (restarted as the in-process vLLM engine is), whose
engine a test kills by sending the process SIGUSR1 (as killing vLLM's EngineCore does).
"""

from __future__ import annotations

import argparse
import signal
import sys

from server.api.config import ServerConfig
from server.cli.serving import serve
from tests.support.fake_engine import FakeEngine, SupervisedFakeEngine


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--shutdown-grace-s", type=float, default=10.0)
    parser.add_argument("--health-port", type=int, default=None)
    parser.add_argument("--step-s", type=float, default=None, help="the fake engine's step time")
    parser.add_argument("--retrain-every", type=int, default=0)
    parser.add_argument("--max-restarts", type=int, default=None,
                        help="a supervised engine, restarted at most N times (SIGUSR1 kills it)")
    parser.add_argument("--restart-delay-s", type=float, default=0.5)
    args = parser.parse_args(argv)
    timing = {"step_s": args.step_s} if args.step_s is not None else {}
    engine: FakeEngine
    if args.max_restarts is None:
        engine = FakeEngine(**timing)
    else:
        supervised = engine = SupervisedFakeEngine(max_restarts=args.max_restarts,
                                                   restart_delay_s=args.restart_delay_s, **timing)
        signal.signal(signal.SIGUSR1, lambda *_: supervised.kill())
    config = ServerConfig(port=args.port, data_dir=args.data_dir, health_port=args.health_port,
                          shutdown_grace_s=args.shutdown_grace_s, retrain_every=args.retrain_every,
                          log_level="info",
                          # as FakeServer: the grammar worker (a process loading xgrammar and
                          # torch) starts at the first JSON schema, not with every test's server
                          grammar_warm_up=False)
    return serve(config, engine=engine)


if __name__ == "__main__":
    sys.exit(main())
