"""Per-type predictors for the server: trained models where they exist, cold start elsewhere."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .base import Predictor
from .cold_start import ColdStartEstimator
from .persistence import METADATA_FILE, PredictorLoadError, load_predictor, read_metadata

log = logging.getLogger(__name__)


def scan(models_dir: str | Path | None) -> tuple[dict[str, tuple[Path, dict[str, Any]]], dict[str, str]]:
    """The predictor directories in ``models_dir`` (itself one, or one per sub-directory) by
    agent type, with their checked metadata; and why the others cannot be used, by path.
    Reads metadata only: no model is unpickled."""
    found: dict[str, tuple[Path, dict[str, Any]]] = {}
    errors: dict[str, str] = {}
    d = Path(models_dir) if models_dir is not None else None
    if d is None or not d.is_dir():
        return found, errors
    candidates = [d] if (d / METADATA_FILE).is_file() else sorted(p for p in d.iterdir() if p.is_dir())
    for p in candidates:
        if not (p / METADATA_FILE).is_file():
            continue
        try:
            meta = read_metadata(p)
        except PredictorLoadError as exc:
            errors[str(p)] = str(exc)
            continue
        found[str(meta.get("agent_type"))] = (p, meta)
    return found, errors


def describe(meta: dict[str, Any], path: Path) -> str:
    """``ridge(alpha=3, numeric only), 50 samples (40 train / 10 held out), models/fv``: one
    predictor (the model cross-validation chose), for the log."""
    counts = f"{meta.get('sample_count', '?')} samples"
    if meta.get("train_count") is not None and meta.get("validation_count") is not None:
        counts += f" ({meta['train_count']} train / {meta['validation_count']} held out)"
    return f"{meta.get('model') or meta.get('kind', 'mlp')}, {counts}, {path}"


class PredictorRegistry:
    """Finds the predictor of every agent type under ``models_dir``.

    ``models_dir`` holds one directory per trained predictor (as written by
    ``justitia train-predictor ... --out models_dir/NAME``; the agent type is read from each
    directory's metadata, not from its name), or is itself one predictor directory. It may
    be ``None`` or missing: then every type uses the cold start. Models load lazily on first
    use; a directory that cannot be loaded is skipped with a warning (see :attr:`errors`) and
    its type falls back to the cold start.
    """

    def __init__(self, models_dir: str | Path | None = None, cold_start: ColdStartEstimator | None = None,
                 online: Any = None):
        self.models_dir = Path(models_dir) if models_dir is not None else None
        #: The :class:`~predictors.online.OnlineTrainer` whose models, once swapped in, serve
        #: their (tenant, type) before any other (None: no online learning).
        self.online = online
        #: The cold start of callers that name no tenant.
        self.cold_start = cold_start or ColdStartEstimator()
        # One cold start per tenant: what one tenant's agents cost never moves another
        # tenant's estimates (and so never its fair finish time or deadline).
        self._cold_by_tenant: dict[str, ColdStartEstimator] = {}
        self.errors: dict[str, str] = {}
        self._paths: dict[str, Path] = {}
        self._loaded: dict[str, Predictor] = {}
        self._lock = threading.Lock()
        self.refresh()

    def refresh(self) -> None:
        """Rescan ``models_dir`` (new or retrained predictors are picked up)."""
        found, errors = scan(self.models_dir)
        for bad, exc in errors.items():
            log.warning("skipping predictor %s: %s", bad, exc)
        for agent_type, (path, meta) in found.items():
            log.info("cost predictor for %r: %s", agent_type, describe(meta, path))
        with self._lock:
            self._paths = {t: path for t, (path, _) in found.items()}
            self._loaded = {t: m for t, m in self._loaded.items() if t in self._paths}
            self.errors = errors

    @property
    def agent_types(self) -> list[str]:
        """Agent types with a trained predictor."""
        return sorted(set(self._paths) | set(self._loaded))

    def add(self, predictor: Predictor) -> None:
        """Use ``predictor`` (already loaded) for its ``agent_type``."""
        with self._lock:
            self._loaded[predictor.agent_type] = predictor

    def has_model(self, agent_type: str) -> bool:
        return not self.get(agent_type).is_cold_start

    def cold_start_of(self, tenant: str | None) -> ColdStartEstimator:
        """The cold-start estimator that learns from ``tenant``'s agents only."""
        if tenant is None:
            return self.cold_start
        estimator = self._cold_by_tenant.get(tenant)
        if estimator is None:
            with self._lock:
                estimator = self._cold_by_tenant.setdefault(
                    tenant, ColdStartEstimator(self.cold_start.default_output_tokens,
                                               self.cold_start.prior_strength,
                                               self.cold_start.max_log_slope,
                                               self.cold_start.prior_log_sigma,
                                               self.cold_start.blend_observations))
        return estimator

    def get(self, agent_type: str, tenant: str | None = None) -> Predictor:
        """The online model of (``tenant``, ``agent_type``), else the trained predictor of
        ``agent_type`` (an operator's, shared by every tenant), else a cold-start predictor
        for it that learns from ``tenant``'s agents only."""
        if self.online is not None:
            p = self.online.get(agent_type, tenant)
            if p is not None:
                return p
        return self._trained_or_cold(agent_type, tenant)

    def _trained_or_cold(self, agent_type: str, tenant: str | None) -> Predictor:
        p: Predictor | None = self._loaded.get(agent_type)
        if p is not None:
            return p
        path = self._paths.get(agent_type)
        if path is not None:
            with self._lock:
                p = self._loaded.get(agent_type)
                if p is None:
                    try:
                        p = load_predictor(path)
                    except PredictorLoadError as exc:
                        self.errors[str(path)] = str(exc)
                        self._paths.pop(agent_type, None)
                        log.warning("predictor for %r unusable, using cold start: %s", agent_type, exc)
                        p = None
                    else:
                        self._loaded[agent_type] = p
            if p is not None:
                return p
        return self.cold_start_of(tenant).for_type(agent_type)

    def observe(self, agent_type: str, prompt: str, cost: float, features: Mapping[str, Any] | None = None,
                tenant: str | None = None) -> None:
        """A completed agent's real cost (improves the cold start of its type, for its
        tenant only)."""
        self.cold_start_of(tenant).observe(agent_type, prompt, cost, features)

    def close(self) -> None:
        """Stop the online retraining's worker process, if there is one."""
        if self.online is not None:
            self.online.close()

    def learn(self, agent_type: str, prompt: str, cost: float, served: float,
              features: Mapping[str, Any] | None = None, tenant: str | None = None) -> None:
        """A completed agent whose cost was predicted as ``served``: a sample for the online
        retraining of (``tenant``, ``agent_type``), if there is one."""
        if self.online is not None:
            self.online.observe(agent_type, tenant, prompt, cost, served, features)

    def describe(self) -> list[dict[str, Any]]:
        """What predicts each agent type: the operator's trained models and, per tenant,
        what online learning has seen and serves (``GET /v1/predictors``)."""
        out = []
        for agent_type in self.agent_types:
            loaded = self._loaded.get(agent_type)
            meta = dict(loaded.metadata) if loaded is not None else {}
            if not meta and agent_type in self._paths:
                try:
                    meta = read_metadata(self._paths[agent_type])
                except PredictorLoadError:
                    continue
            validation = meta.get("validation") or {}
            out.append({"agent_type": agent_type, "tenant": None, "source": "trained",
                        "samples": meta.get("sample_count"), "kind": meta.get("kind", "mlp"),
                        "model": meta.get("model"), "trained_on": meta.get("train_count"),
                        "recent_error": ({k: validation[k] for k in ("mean_relative_error", "median_relative_error")
                                          if k in validation} or None),
                        "last_trained": meta.get("created_at")})
        for row in self.online.describe() if self.online is not None else []:
            if row["kind"] is None:  # nothing swapped in yet: say what serves instead
                serving = self._trained_or_cold(row["agent_type"], row["tenant"] or None)
                row["kind"] = serving.metadata.get("kind", "mlp")
                row["model"] = serving.metadata.get("model")
            out.append({"source": "online", **row})
        return out
