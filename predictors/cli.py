"""``justitia train-predictor`` and ``justitia predictor eval``.

Only argparse at module level: scikit-learn loads when a handler runs.
"""

from __future__ import annotations

import argparse

from justitia_cli import Commands
from justitia_cli.options import add_command, json_option, quiet_option, seed_option


def register(commands: Commands) -> None:
    p = add_command(
        commands.root,
        "train-predictor",
        help="Train the cost predictor of one agent type (TF-IDF + MLP, ridge or median, by cross-validation).",
        description=(
            "Train the cost predictor of agent type AGENT from profiled runs or a server's "
            "history: cross-validation on the training 80% chooses the model (MLP, ridge or "
            "the median) and its p50/p90 interval; it is validated on the held-out 20% against "
            "the baselines (training mean and median, one global model, length-only linear, "
            "cold start) and written to --out, with the held-out samples "
            "(DIR/heldout.jsonl, what `justitia predictor eval DIR` uses by default). Samples "
            "profiled (--inputs) or fetched (--from-server) are kept in DIR/samples.jsonl "
            "(or --save-samples FILE), written before training starts."
        ),
        handler=_train,
    )
    p.add_argument("agent", metavar="AGENT",
                   help="agent type: the name its @agent registered (selects the samples' agent_type)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--module", metavar="PKG.MOD", help="import this module to resolve AGENT (for --inputs)")
    where.add_argument("--file", metavar="PATH.py", help="load this Python file to resolve AGENT (for --inputs)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--samples", metavar="FILE",
                     help="JSON Lines of {agent_type, prompt, cost, features} (.gz allowed)")
    src.add_argument("--inputs", metavar="FILE",
                     help="JSON Lines of the agent's arguments: profile it against a running server")
    src.add_argument("--from-server", metavar="URL", dest="from_server",
                     help="fetch the completed agents of AGENT from a Justitia server's history")
    src.add_argument("--from-history", metavar="PATH_OR_URL", dest="from_history",
                     help="the finished agents of AGENT in a server's history: its history file "
                          "(DATA_DIR/history.sqlite3, read-only, every tenant) or its URL "
                          "(GET /v1/history, the --api-key's tenant)")
    p.add_argument("--out", metavar="DIR", required=True, help="directory to write the trained predictor into")
    p.add_argument("--save-samples", metavar="FILE", dest="save_samples", default=None,
                   help="write the samples used (all types, JSON Lines, .gz allowed) to FILE "
                        "(unset: DIR/samples.jsonl with --inputs or --from-server; not written "
                        "with --samples, which is already a file)")
    p.add_argument("--alpha", type=float, default=None,
                   help="fix the MLP's L2 penalty (unset: cross-validation chooses among the candidates)")
    seed_option(p, "seed of the train/validation split and of the MLP")
    p.add_argument("--no-calibrate", dest="calibrate", action="store_false",
                   help="predict the median cost instead of scaling it down to minimise the mean relative error")
    p.add_argument("--server", metavar="URL", default=None,
                   help="server to profile against with --inputs (unset: $JUSTITIA_URL or http://127.0.0.1:8000)")
    p.add_argument("--concurrency", type=int, default=None,
                   help=("with --inputs: runs in flight at once (default 64, the SDK's batch default; "
                         "1 gives each run the whole engine, as the paper profiles; more runs "
                         "at once profile faster but share the engine)"))
    p.add_argument("--api-key", metavar="KEY", default=None,
                   help="bearer token for --from-server / --inputs (default: $JUSTITIA_API_KEY)")
    p.add_argument("--timeout", type=float, default=30.0, help="HTTP timeout in seconds for --from-server")
    json_option(p, "also write the training report as JSON")
    quiet_option(p, "print only the output directory")

    e = add_command(
        commands.predictor,
        "eval",
        help="Measure a trained predictor's error and latency on samples.",
        description=(
            "Evaluate the predictor in DIR on the samples of its agent type: relative error "
            "|predicted - actual| / actual and the latency of one prediction. Without "
            "--samples, on the held-out samples stored with the model (DIR/heldout.jsonl: the "
            "runs `justitia train-predictor` held out from training and validated it on)."
        ),
        handler=_eval,
    )
    e.add_argument("dir", metavar="DIR", help="predictor directory written by `justitia train-predictor`")
    e.add_argument("--samples", metavar="FILE", default=None,
                   help="JSON Lines samples; only those of the predictor's agent type are used "
                        "(unset: the held-out samples stored with the model, DIR/heldout.jsonl)")
    json_option(e, "write the results as JSON to this file")
    e.add_argument("--all-types", action="store_true",
                   help="use every sample, whatever its agent_type (e.g. to test a global model)")


def _train(args: argparse.Namespace) -> int:
    from .cli_impl import train_command

    return train_command(args)


def _eval(args: argparse.Namespace) -> int:
    from .cli_impl import eval_command

    return eval_command(args)
