"""The work behind ``justitia train-predictor`` and ``justitia predictor eval``."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

from justitia_sdk.cli import CommandError

from .samples import Sample, SampleError, parse_samples, read_samples


# -- sample sources -------------------------------------------------------------------------

def samples_from_server(url: str, agent_type: str, api_key: str | None = None, timeout: float = 30.0) -> list[Sample]:
    """Completed agents of ``agent_type`` from ``GET {url}/v1/history?agent_type=T``."""
    import httpx

    base = url.rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise CommandError(f"--from-server needs an http(s) URL, got {url!r} (e.g. http://127.0.0.1:8000)")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(f"{base}/v1/history", params={"agent_type": agent_type}, headers=headers, timeout=timeout)
    except httpx.TimeoutException:
        raise CommandError(f"server {base} did not answer within {timeout:g} s; check it is running or raise --timeout") from None
    except httpx.HTTPError as exc:
        raise CommandError(f"cannot reach server {base} ({exc.__class__.__name__}); start it with `justitia serve` or fix the URL") from None
    if r.status_code in (401, 403):
        raise CommandError(f"server {base} refused the request ({r.status_code}); pass a valid --api-key")
    if r.status_code == 404:
        raise CommandError(f"server {base} has no /v1/history endpoint (404); is it a Justitia server of this version?")
    if r.status_code >= 400:
        detail = ""
        try:
            detail = str(r.json().get("detail", ""))
        except Exception:
            pass
        raise CommandError(f"server {base} answered {r.status_code} {detail}".rstrip())
    try:
        body = r.json()
    except ValueError:
        raise CommandError(f"server {base} returned non-JSON history; is it a Justitia server?") from None
    rows = body.get("samples") if isinstance(body, dict) else None
    if not isinstance(rows, list):
        raise CommandError(f"server {base} history has no 'samples' list; is it a Justitia server of this version?")
    try:
        return parse_samples(rows, source=f"{base} history")
    except SampleError as exc:
        raise CommandError(str(exc)) from None


def _check_reachable(url: str, timeout: float = 5.0) -> None:
    """Fail fast, before profiling retries for a long time, when nothing answers at ``url``."""
    import httpx

    if not url.startswith(("http://", "https://")):
        raise CommandError(f"--server needs an http(s) URL, got {url!r} (e.g. http://127.0.0.1:8000)")
    try:
        httpx.get(url.rstrip("/") + "/healthz", timeout=timeout)
    except httpx.HTTPError as exc:
        raise CommandError(
            f"cannot reach server {url} ({exc.__class__.__name__}); start it with `justitia serve` or pass --server URL"
        ) from None


def resolve_agent(name: str, module: str | None, file: str | None) -> Any:
    """Import ``--module``/``--file`` and find the agent registered under ``name``."""
    if file:
        path = Path(file)
        if not path.is_file():
            raise CommandError(f"--file {file}: no such file")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        if spec is None or spec.loader is None:
            raise CommandError(f"--file {file}: not a Python file")
        mod = importlib.util.module_from_spec(spec)
        sys.modules.setdefault(path.stem, mod)
        try:
            spec.loader.exec_module(mod)
        except Exception as exc:
            raise CommandError(f"--file {file} failed to import ({exc.__class__.__name__}: {exc})") from None
    elif module:
        try:
            importlib.import_module(module)
        except Exception as exc:
            raise CommandError(f"--module {module} failed to import ({exc.__class__.__name__}: {exc})") from None
    import justitia_sdk

    get_agent = getattr(justitia_sdk, "get_agent", None)
    if get_agent is None:
        raise CommandError(
            "resolving an agent by name needs the SDK's @agent registry (justitia_sdk.get_agent), "
            "which this installation does not have yet; use --samples or --from-server"
        )
    try:
        found = get_agent(name)
    except Exception:
        found = None
    if found is None:
        names = []
        lister = getattr(justitia_sdk, "registered_agents", None)
        if lister is not None:
            try:
                names = sorted(lister())
            except Exception:
                names = []
        where = f" in {module or file}" if (module or file) else "; pass --module PKG.MOD or --file PATH.py"
        known = f" (registered: {', '.join(names)})" if names else ""
        raise CommandError(f"no agent named {name!r} is registered{where}{known}")
    return found


def samples_from_inputs(args: argparse.Namespace) -> list[Sample]:
    """Profile the agent over an inputs file against a running server (needs the SDK)."""
    inputs = Path(args.inputs)
    if not inputs.is_file():
        raise CommandError(f"--inputs {inputs}: no such file")
    fn = resolve_agent(args.agent, args.module, args.file)
    import justitia_sdk

    profile = getattr(justitia_sdk, "profile_agent", None)
    if profile is None:
        raise CommandError(
            "--inputs profiling needs the SDK's profiler (justitia_sdk.profile_agent), which this "
            "installation does not have; use --samples or --from-server"
        )
    url = args.server or justitia_sdk.default_url()
    _check_reachable(url)
    rows = []
    for lineno, line in enumerate(inputs.read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                raise CommandError(f"{inputs}:{lineno}: not valid JSON") from None
    if not rows:
        raise CommandError(f"--inputs {inputs} holds no inputs")
    try:
        records = profile(fn, rows, server=url, api_key=args.api_key or os.environ.get("JUSTITIA_API_KEY"),
                          concurrency=args.concurrency)
    except CommandError:
        raise
    except justitia_sdk.ServerUnavailableError:
        raise CommandError(f"cannot reach server {url}; start it with `justitia serve` or pass --server URL") from None
    except justitia_sdk.AuthenticationError:
        raise CommandError(f"server {url} refused the API key; pass a valid --api-key") from None
    except Exception as exc:
        msg = " ".join(str(exc).split())
        raise CommandError(f"profiling {args.agent} failed ({exc.__class__.__name__}: {msg})") from None
    if not records:
        raise CommandError(f"no run of {args.agent} over {inputs} finished; check the server log and the inputs")
    try:
        return parse_samples(list(records), source=f"profiling {args.agent}")
    except SampleError as exc:
        raise CommandError(str(exc)) from None


# -- commands -------------------------------------------------------------------------------

def _fmt(x: float | None) -> str:
    return "—" if x is None else f"{x:.3f}"


def _print_report(report: dict[str, Any], out: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(stderr=False)
    title = (f"[bold]{report['agent_type']}[/]: {report['samples']} samples "
             f"({report['train']} train / {report['validation']} held out), "
             f"trained in {report['train_seconds']:.2f} s, hidden layers {tuple(report['hidden_layers'])}")
    t = Table(title="held-out relative error |pred - actual| / actual", title_justify="left")
    t.add_column("predictor")
    t.add_column("mean", justify="right")
    t.add_column("median", justify="right")
    t.add_column("p90", justify="right")
    rows = [("MLP (this model)", report["mlp"])]
    names = {"mean": "training mean", "global": "one global model", "length_linear": "length-only linear"}
    for k, label in names.items():
        rows.append((label, report["baselines"].get(k)))
    rows.append(("cold start (fed the training runs)", report["cold_start"]))
    for label, r in rows:
        if r is None:
            t.add_row(label, "—", "—", "— (needs other agent types in the samples)")
        else:
            style = "bold green" if label.startswith("MLP") else None
            t.add_row(label, _fmt(r["mean_relative_error"]), _fmt(r["median_relative_error"]),
                      _fmt(r.get("p90_relative_error")), style=style)
    console.print(title)
    console.print(t)
    if report.get("warning"):
        console.print(f"[yellow]warning:[/] {report['warning']}")
    console.print(f"wrote {out}")


def train_command(args: argparse.Namespace) -> int:
    from .model import DEFAULT_ALPHA
    from .persistence import save_predictor
    from .training import train_predictor

    if args.alpha is not None and not args.alpha > 0:
        raise CommandError("--alpha must be a positive number")
    if args.samples:
        if args.module or args.file:
            resolve_agent(args.agent, args.module, args.file)
        try:
            samples = read_samples(args.samples)
        except SampleError as exc:
            raise CommandError(str(exc)) from None
        source = args.samples
    elif args.from_server:
        if args.module or args.file:
            resolve_agent(args.agent, args.module, args.file)
        samples = samples_from_server(args.from_server, args.agent,
                                      args.api_key or os.environ.get("JUSTITIA_API_KEY"), args.timeout)
        source = f"{args.from_server} history"
    else:
        samples = samples_from_inputs(args)
        source = f"profiling {args.inputs}"
    if not any(s.agent_type == args.agent for s in samples):
        types = sorted({s.agent_type for s in samples})
        raise CommandError(
            f"no samples of agent type {args.agent!r} in {source}; types present: {', '.join(types) or 'none'}"
        )
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise CommandError(f"--out {out} exists and is not a directory")
    try:
        result = train_predictor(samples, args.agent, alpha=args.alpha or DEFAULT_ALPHA, seed=args.seed,
                                 calibrate=getattr(args, "calibrate", True))
    except SampleError as exc:
        raise CommandError(str(exc)) from None
    result.predictor.metadata["source"] = source
    try:
        save_predictor(result.predictor, out)
    except OSError as exc:
        raise CommandError(f"cannot write predictor to {out} ({exc.strerror or exc}); check the path") from None
    if args.json:
        _write_json(args.json, result.report)
    if args.quiet:
        print(out)
    else:
        _print_report(result.report, out)
    return 0


def _write_json(path: str, obj: Any) -> None:
    p = Path(path)
    try:
        if p.parent and not p.parent.exists():
            p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
    except OSError as exc:
        raise CommandError(f"cannot write {p} ({exc.strerror or exc})") from None


def eval_command(args: argparse.Namespace) -> int:
    from .evaluation import evaluate
    from .persistence import PredictorLoadError, load_predictor

    try:
        predictor = load_predictor(args.dir)
    except PredictorLoadError as exc:
        raise CommandError(str(exc)) from None
    try:
        samples = read_samples(args.samples)
    except SampleError as exc:
        raise CommandError(str(exc)) from None
    if not args.all_types:
        own = [s for s in samples if s.agent_type == predictor.agent_type]
        if not own:
            types = sorted({s.agent_type for s in samples})
            raise CommandError(
                f"no samples of agent type {predictor.agent_type!r} (the predictor's) in {args.samples}; "
                f"types present: {', '.join(types)}; pass --all-types to use them anyway"
            )
        samples = own
    result = {"agent_type": predictor.agent_type, **evaluate(predictor, samples)}
    if args.json:
        _write_json(args.json, result)
    from rich.console import Console

    Console().print(
        f"[bold]{predictor.agent_type}[/]: n={result['n']}  mean rel. error {result['mean_relative_error']:.3f}  "
        f"median {result['median_relative_error']:.3f}  latency p50 {result['p50_latency_ms']:.3f} ms  "
        f"p99 {result['p99_latency_ms']:.3f} ms"
    )
    return 0
