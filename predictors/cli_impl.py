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

from justitia_cli import CommandError

from .samples import Sample, SampleError, parse_samples, read_samples, write_samples

#: Where ``train-predictor`` keeps the samples it profiled or fetched, inside ``--out``.
SAMPLES_FILE = "samples.jsonl"


# -- sample sources -------------------------------------------------------------------------

def _get_history(base: str, params: dict[str, str], api_key: str | None,
                 timeout: float) -> tuple[list[Any], str | None]:
    """The ``samples`` rows of one page of ``GET {base}/v1/history`` and its next cursor."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(f"{base}/v1/history", params=params, headers=headers, timeout=timeout)
    except httpx.TimeoutException:
        raise CommandError(f"server {base} did not answer within {timeout:g} s; "
                           "check it is running or raise --timeout") from None
    except httpx.HTTPError as exc:
        raise CommandError(f"cannot reach server {base} ({exc.__class__.__name__}); "
                           "start it with `justitia serve` or fix the URL") from None
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
    cursor = body.get("next_cursor")
    return rows, str(cursor) if cursor else None


def samples_from_server(url: str, agent_type: str, api_key: str | None = None, timeout: float = 30.0) -> list[Sample]:
    """Completed agents of ``agent_type`` from ``GET {url}/v1/history?agent_type=T``."""
    base = url.rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise CommandError(f"--from-server needs an http(s) URL, got {url!r} (e.g. http://127.0.0.1:8000)")
    rows: list[Any] = []
    params = {"agent_type": agent_type}
    while True:  # every page: a long history is served 10,000 samples at a time
        page, cursor = _get_history(base, params, api_key, timeout)
        rows.extend(page)
        if cursor is None:
            break
        params = {"agent_type": agent_type, "cursor": cursor}
    if not rows:
        # The server filtered by type, so the answer cannot say which types it has: ask again
        # without the filter (only on this error path) to name them.
        everything, more = _get_history(base, {}, api_key, timeout)  # more: a cursor
        types = sorted({str(r["agent_type"]) for r in everything if isinstance(r, dict) and r.get("agent_type")})
        among = f" among its first {len(everything)} finished agents" if more else ""
        present = f"types present{among}: {', '.join(types)}" if types else "it has no finished agent yet"
        tenant = " for this API key's tenant" if api_key else ""
        raise CommandError(f"no samples of agent type {agent_type!r} in {base} history{tenant}; {present}")
    try:
        return parse_samples(rows, source=f"{base} history")
    except SampleError as exc:
        raise CommandError(str(exc)) from None


def samples_from_history_file(path: str, agent_type: str) -> list[Sample]:
    """Finished agents of ``agent_type`` in a server's history file, read-only (the server
    may be running: SQLite's WAL lets a reader in beside the writer)."""
    import sqlite3

    from .history import HISTORY_QUERY, history_sample

    p = Path(path)
    if not p.is_file():
        raise CommandError(f"--from-history {path}: no such file; give the server's DATA_DIR/history.sqlite3 "
                           "or its URL (http://HOST:PORT)")
    try:
        db = sqlite3.connect(f"file:{p.resolve()}?mode=ro", uri=True)
        try:
            rows = db.execute(HISTORY_QUERY + " AND type = ? ORDER BY rowid", (0, agent_type)).fetchall()
            types = [t for (t,) in db.execute("SELECT DISTINCT type FROM agents WHERE state = 'finished'")]
        finally:
            db.close()
    except sqlite3.Error as exc:
        raise CommandError(f"--from-history {path} is not a readable Justitia history ({exc})") from None
    if not rows:
        present = f"types present: {', '.join(sorted(types))}" if types else "it has no finished agent yet"
        raise CommandError(f"no samples of agent type {agent_type!r} in {path}; {present}")
    try:
        return parse_samples([history_sample(row) for row in rows], source=str(p))
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


def _read_inputs(inputs: Path) -> list[Any]:
    """The inputs of an `--inputs` JSON Lines file (blank lines skipped), at least one."""
    rows = []
    for lineno, line in enumerate(inputs.read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                raise CommandError(f"{inputs}:{lineno}: not valid JSON") from None
    if not rows:
        raise CommandError(f"--inputs {inputs} holds no inputs")
    return rows


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
    rows = _read_inputs(inputs)
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
    layers = f", hidden layers {tuple(report['hidden_layers'])}" if report.get("hidden_layers") else ""
    title = (f"[bold]{report['agent_type']}[/]: {report['samples']} samples "
             f"({report['train']} train / {report['validation']} held out), "
             f"model {report['model_name']} chosen by cross-validation{layers}, "
             f"trained in {report['train_seconds']:.2f} s")
    t = Table(title="held-out relative error |pred - actual| / actual", title_justify="left")
    t.add_column("predictor")
    t.add_column("mean", justify="right")
    t.add_column("median", justify="right")
    t.add_column("p90", justify="right")
    rows = [(f"{report['kind']} (this model)", report["model"])]
    names = {"mean": "training mean", "median": "training median", "global": "one global model",
             "length_linear": "length-only linear"}
    for k, label in names.items():
        rows.append((label, report["baselines"].get(k)))
    rows.append(("cold start (fed the training runs)", report["cold_start"]))
    for label, r in rows:
        if r is None:
            t.add_row(label, "—", "—", "— (needs other agent types in the samples)")
        else:
            style = "bold green" if label.endswith("(this model)") else None
            t.add_row(label, _fmt(r["mean_relative_error"]), _fmt(r["median_relative_error"]),
                      _fmt(r.get("p90_relative_error")), style=style)
    console.print(title)
    console.print(t)
    m = report["model"]
    if m.get("p90_coverage") is not None:
        console.print(f"interval coverage on the held-out runs: p50 {m['p50_coverage']:.2f}, "
                      f"p90 {m['p90_coverage']:.2f} (share of real costs at most each)")
    if report.get("warning"):
        console.print(f"[yellow]warning:[/] {report['warning']}")
    console.print(f"wrote {out}")


def _collect(args: argparse.Namespace) -> tuple[list[Sample], str, bool]:
    """The samples of the chosen source, a description of it, and whether they were
    gathered by this command (profiled or fetched: worth keeping) rather than read."""
    if args.samples:
        if args.module or args.file:
            resolve_agent(args.agent, args.module, args.file)
        try:
            return read_samples(args.samples), args.samples, False
        except SampleError as exc:
            raise CommandError(str(exc)) from None
    server = args.from_server or getattr(args, "from_history", None)
    if server and (args.from_server or server.startswith(("http://", "https://"))):
        if args.module or args.file:
            resolve_agent(args.agent, args.module, args.file)
        samples = samples_from_server(server, args.agent,
                                      args.api_key or os.environ.get("JUSTITIA_API_KEY"), args.timeout)
        return samples, f"{server} history", True
    if server:
        return samples_from_history_file(server, args.agent), f"history {server}", True
    return samples_from_inputs(args), f"profiling {args.inputs}", True


def _save_samples(samples: list[Sample], args: argparse.Namespace, gathered: bool, out: Path) -> Path | None:
    """Keep what was profiled or fetched (``--save-samples``, default ``DIR/samples.jsonl``),
    before training, so that a failed training run does not lose an expensive profile."""
    target = args.save_samples or (str(out / SAMPLES_FILE) if gathered else None)
    if target is None:
        return None
    try:
        write_samples(samples, target)
    except OSError as exc:
        raise CommandError(f"cannot write samples to {target} ({exc.strerror or exc}); check --save-samples") from None
    return Path(target)


def train_command(args: argparse.Namespace) -> int:
    from .persistence import save_predictor
    from .training import train_predictor

    if args.alpha is not None and not args.alpha > 0:
        raise CommandError("--alpha must be a positive number")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise CommandError(f"--out {out} exists and is not a directory")
    samples, source, gathered = _collect(args)
    kept = _save_samples(samples, args, gathered, out)
    if kept is not None and not args.quiet:
        print(f"kept the {len(samples)} samples of {source} in {kept}")
    if not any(s.agent_type == args.agent for s in samples):
        types = sorted({s.agent_type for s in samples})
        raise CommandError(
            f"no samples of agent type {args.agent!r} in {source}; types present: {', '.join(types) or 'none'}"
        )
    try:
        result = train_predictor(samples, args.agent, alpha=args.alpha, seed=args.seed,
                                 calibrate=getattr(args, "calibrate", True))
    except SampleError as exc:
        where = f" (the samples are kept in {kept})" if kept is not None else ""
        raise CommandError(f"{exc}{where}") from None
    result.predictor.metadata["source"] = source
    if kept is not None:
        result.predictor.metadata["samples_file"] = str(kept)
    try:
        save_predictor(result.predictor, out, heldout=result.heldout)
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
    from server.sim.provenance import with_provenance

    if isinstance(obj, dict):
        obj = with_provenance(dict(obj))
    p = Path(path)
    try:
        if p.parent and not p.parent.exists():
            p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
    except OSError as exc:
        raise CommandError(f"cannot write {p} ({exc.strerror or exc})") from None


def _eval_samples(args: argparse.Namespace) -> tuple[list[Sample], str]:
    """``--samples FILE``, or else the held-out samples stored with the predictor."""
    from .persistence import HELDOUT_FILE, PredictorLoadError, load_heldout

    if args.samples:
        try:
            return read_samples(args.samples), args.samples
        except SampleError as exc:
            raise CommandError(str(exc)) from None
    try:
        return load_heldout(args.dir), str(Path(args.dir) / HELDOUT_FILE)
    except PredictorLoadError as exc:
        raise CommandError(str(exc)) from None


def eval_command(args: argparse.Namespace) -> int:
    from .evaluation import evaluate
    from .persistence import PredictorLoadError, load_predictor

    try:
        predictor = load_predictor(args.dir)
    except PredictorLoadError as exc:
        raise CommandError(str(exc)) from None
    samples, source = _eval_samples(args)
    if not args.all_types:
        own = [s for s in samples if s.agent_type == predictor.agent_type]
        if not own:
            types = sorted({s.agent_type for s in samples})
            raise CommandError(
                f"no samples of agent type {predictor.agent_type!r} (the predictor's) in {source}; "
                f"types present: {', '.join(types)}; pass --all-types to use them anyway"
            )
        samples = own
    result = {"agent_type": predictor.agent_type, "samples_file": source, **evaluate(predictor, samples)}
    if args.json:
        _write_json(args.json, result)
    from rich.console import Console
    from rich.markup import escape

    cover = ("" if result["p90_coverage"] is None else
             f"  coverage p50 {result['p50_coverage']:.2f} p90 {result['p90_coverage']:.2f}")
    Console().print(
        f"[bold]{escape(predictor.agent_type)}[/] ({escape(str(result['model'] or result['kind']))}) on "
        f"{escape(source)}: n={result['n']}  mean rel. error "
        f"{result['mean_relative_error']:.3f}  median {result['median_relative_error']:.3f}{cover}  "
        f"latency p50 {result['p50_latency_ms']:.3f} ms  p99 {result['p99_latency_ms']:.3f} ms"
    )
    return 0
