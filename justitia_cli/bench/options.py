"""What the `bench` commands share: their policy list, workload, profile and prediction
options, read and checked (bad input is a `CommandError` naming the option)."""

from __future__ import annotations

import argparse

from justitia_cli import CommandError
from server.scheduler import LIVE_ONLY, POLICY_NAMES


def las_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--las-half-life-s", type=float, default=60.0, metavar="SECONDS",
                        help="half-life of the las policy's attained service (default 60 s, as llm-d's plugin)")
    parser.add_argument("--las-head-wait-weight", type=float, default=0.2, metavar="W",
                        help="weight of the head request's wait in las's score, against 0.8 for the "
                             "attained service (default 0.2, as llm-d's plugin; 0: pure least attained service)")


def configured_policies(args: argparse.Namespace, names: list[str]) -> list:
    """The policies called `names`, configured by the command's options (las's half-life)."""
    from server.scheduler import get_policy

    half_life, wait = args.las_half_life_s, args.las_head_wait_weight
    if not 0 < half_life < float("inf"):
        raise CommandError(f"--las-half-life-s must be a positive number of seconds, not {half_life}")
    if not 0 <= wait < float("inf"):
        raise CommandError(f"--las-head-wait-weight must be a number >= 0, not {wait}")
    return [get_policy(n, las_half_life_s=half_life, las_head_wait_weight=wait) for n in names]


def split_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def parse_policies(text: str, live_only: bool = False) -> list[str]:
    """The policies of `--policies`; `live_only`: also those only a live server on Ray runs."""
    policies = split_list(text)
    known = POLICY_NAMES + (LIVE_ONLY if live_only else ())
    bad = [p for p in policies if p not in known]
    if bad or not policies:
        hint = ("" if live_only or not set(bad) & set(LIVE_ONLY)
                else f" ({', '.join(LIVE_ONLY)}: `bench live --ray` only)")
        raise CommandError(f"unknown policy {', '.join(bad) or '(none)'}{hint}: choose from {', '.join(known)}")
    return policies


def read_workload(path: str, hint: str = "`justitia bench make-workload`"):
    from server.sim.workload import WorkloadError, load_workload

    try:
        agents = load_workload(path)
    except FileNotFoundError:
        raise CommandError(f"no workload file {path}: build one with {hint}") from None
    except WorkloadError as exc:
        raise CommandError(str(exc)) from None
    if not agents:
        raise CommandError(f"{path} holds no agents")
    return agents


def read_profile(name: str):
    from server.shared.profiles import load_profile

    try:
        return load_profile(name)
    except ValueError as exc:
        raise CommandError(str(exc)) from None


def read_predictions(args, agents):
    from server.sim.simulator import make_predictions

    mode = args.prediction
    if mode == "oracle" or mode.startswith("noisy:"):
        try:
            return make_predictions(agents, mode, seed=args.seed)
        except ValueError as exc:
            raise CommandError(f"--prediction {mode}: {exc} (e.g. noisy:3)") from None
    if mode.startswith("model:"):
        from pathlib import Path

        root = Path(mode.split(":", 1)[1])
        try:
            from predictors import load_predictor  # the predictors package (lazy: heavy)
        except ImportError:
            raise CommandError(
                "--prediction model:DIR needs predictors.load_predictor, which this install lacks; "
                "use oracle or noisy:LAMBDA"
            ) from None
        if not root.is_dir():
            raise CommandError(f"no predictor directory {root}: train one with `justitia train-predictor`")
        # DIR is one predictor for every agent, or holds one sub-directory per agent type.
        models: dict[str, object] = {}
        for t in sorted({a.type for a in agents}):
            path = root / t if (root / t).is_dir() else root
            try:
                models[t] = load_predictor(path)
            except (OSError, ValueError) as exc:
                raise CommandError(f"cannot load a predictor for agent type {t!r} from {path}: {exc}") from None
        return make_predictions(agents, mode, predictor=lambda a: models[a.type].predict(a.prompt or a.type, None))
    raise CommandError(f"unknown --prediction {mode!r}: use oracle, noisy:LAMBDA or model:DIR")
