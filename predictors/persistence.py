"""Saving and loading predictors: ``DIR/model.joblib`` + ``DIR/metadata.json`` (+
``DIR/heldout.jsonl``, the samples held out from training, for ``justitia predictor eval DIR``).

``metadata.json`` is plain JSON, readable without unpickling anything: format version,
agent type, feature set, sample counts, hyper-parameters, validation errors, the versions of
the libraries that trained the model and the SHA-256 of ``model.joblib``. Loading checks, in
this order and before unpickling: the metadata parses, the format version is ours, the
scikit-learn version matches (same major.minor; scikit-learn pickles are not portable across
releases), the model file's checksum matches. Then it unpickles and checks the object's type.

A joblib file is a pickle: load only predictors you (or your server) trained. The checksum
catches corruption and truncation, not a deliberately crafted file placed next to a forged
metadata file.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1
MODEL_FILE = "model.joblib"
METADATA_FILE = "metadata.json"
HELDOUT_FILE = "heldout.jsonl"


class PredictorLoadError(ValueError):
    """A predictor directory that cannot be loaded; the message says why and what to do."""


def library_versions() -> dict[str, str]:
    import joblib
    import numpy
    import sklearn

    try:
        from importlib.metadata import version

        justitia = version("justitia")
    except Exception:  # not installed (running from a source tree)
        justitia = "unknown"
    return {
        "python": platform.python_version(),
        "sklearn": sklearn.__version__,
        "numpy": numpy.__version__,
        "joblib": joblib.__version__,
        "justitia": justitia,
    }


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _major_minor(v: str) -> tuple[str, ...]:
    return tuple(v.split(".")[:2])


def save_predictor(predictor, directory: str | Path, heldout: Sequence[Any] | None = None) -> Path:
    """Write ``predictor`` (a :class:`~predictors.model.CostPredictor`) into ``directory``,
    with ``heldout`` (the :class:`~predictors.samples.Sample` s it was validated on, if given)
    as ``heldout.jsonl``."""
    import joblib

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    heldout_meta: dict[str, Any] = {"heldout_file": None}
    if heldout:
        heldout_meta = {"heldout_file": HELDOUT_FILE, "heldout_count": _write_heldout(heldout, d)}
    # Write to temporary names, then rename: a crash never leaves a half-written model
    # next to metadata that vouches for it.
    fd, tmp_model = tempfile.mkstemp(prefix=".model-", dir=d)
    os.close(fd)
    joblib.dump(predictor.model, tmp_model, compress=3)
    meta = dict(predictor.metadata)
    meta.update(
        **heldout_meta,
        format_version=FORMAT_VERSION,
        versions=library_versions(),
        model_file=MODEL_FILE,
        model_sha256=_sha256(Path(tmp_model)),
    )
    predictor.metadata = meta
    os.replace(tmp_model, d / MODEL_FILE)
    fd, tmp_meta = tempfile.mkstemp(prefix=".metadata-", dir=d)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp_meta, d / METADATA_FILE)
    return d


def _write_heldout(samples: Sequence[Any], d: Path) -> int:
    """Write the held-out samples under a temporary name, then rename (written before the
    metadata that names them, as the model is)."""
    from .samples import write_samples

    fd, tmp = tempfile.mkstemp(prefix=".heldout-", suffix=".jsonl", dir=d)
    os.close(fd)
    n = write_samples(samples, tmp)
    os.replace(tmp, d / HELDOUT_FILE)
    return n


def load_heldout(directory: str | Path) -> list[Any]:
    """The samples ``directory``'s predictor was held out from training and validated on."""
    from .samples import SampleError, read_samples

    d = Path(directory)
    meta = read_metadata(d)
    name = meta.get("heldout_file")
    if not name:
        raise PredictorLoadError(
            f"{d} keeps no held-out samples (trained by an older `justitia train-predictor`); "
            "pass --samples FILE, or retrain it"
        )
    try:
        return read_samples(d / str(name))
    except SampleError as exc:
        raise PredictorLoadError(f"held-out samples of {d}: {exc}; pass --samples FILE, or retrain it") from None


def read_metadata(directory: str | Path) -> dict[str, Any]:
    """The checked metadata of a predictor directory (no unpickling)."""
    d = Path(directory)
    hint = "train one with `justitia train-predictor AGENT --samples FILE --out DIR`"
    if not d.is_dir():
        raise PredictorLoadError(f"{d} is not a directory; {hint}")
    mpath = d / METADATA_FILE
    try:
        meta = json.loads(mpath.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PredictorLoadError(f"{d} holds no {METADATA_FILE}: not a predictor directory; {hint}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        raise PredictorLoadError(f"{mpath} is unreadable or corrupt; retrain: {hint}") from None
    if not isinstance(meta, dict):
        raise PredictorLoadError(f"{mpath} is corrupt (not a JSON object); retrain: {hint}")
    fv = meta.get("format_version")
    if fv != FORMAT_VERSION:
        raise PredictorLoadError(
            f"{d} has predictor format version {fv!r}, this Justitia reads version {FORMAT_VERSION}; retrain: {hint}"
        )
    import sklearn

    trained = str((meta.get("versions") or {}).get("sklearn", "unknown"))
    if _major_minor(trained) != _major_minor(sklearn.__version__):
        raise PredictorLoadError(
            f"{d} was trained with scikit-learn {trained}, this environment has {sklearn.__version__}; "
            f"retrain it here or install scikit-learn {trained}"
        )
    return meta


def load_predictor(directory: str | Path):
    """Load a trained :class:`~predictors.model.CostPredictor` from ``directory``."""
    import joblib
    from sklearn.compose import TransformedTargetRegressor

    from .model import CostPredictor

    d = Path(directory)
    meta = read_metadata(d)
    mfile = d / str(meta.get("model_file") or MODEL_FILE)
    if not mfile.is_file():
        raise PredictorLoadError(f"{mfile} is missing; retrain with `justitia train-predictor`")
    if meta.get("model_sha256") != _sha256(mfile):
        raise PredictorLoadError(f"{mfile} is corrupt (checksum mismatch with {METADATA_FILE}); retrain it")
    try:
        model = joblib.load(mfile)
    except Exception as exc:  # any unpickling failure means a bad file
        raise PredictorLoadError(f"{mfile} cannot be loaded ({exc.__class__.__name__}); retrain it") from None
    if not isinstance(model, TransformedTargetRegressor):
        raise PredictorLoadError(f"{mfile} does not hold a Justitia cost model; retrain it")
    try:
        return CostPredictor(model, meta)
    except Exception as exc:
        raise PredictorLoadError(f"{mfile} holds an unexpected model ({exc}); retrain it") from None
