"""docs/results.md and the README's table are what the curated result files say, and a
curated file without provenance is reported (benchmarks/results_page.py, `make check`)."""

import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import results_page  # noqa: E402


@pytest.fixture
def repo(tmp_path):
    """A copy of what the page is made of: the curated files, the page and the README."""
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "docs").mkdir()
    for name in {e.file for e in results_page.ENTRIES}:
        shutil.copy(ROOT / "benchmarks" / "results" / name, tmp_path / "benchmarks" / "results" / name)
    shutil.copy(ROOT / "docs" / "results.md", tmp_path / "docs" / "results.md")
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    return tmp_path


def test_the_checked_in_page_and_readme_regenerate_identically(capsys):
    assert results_page.main(["--check"]) == 0, capsys.readouterr().err


def test_every_curated_file_carries_provenance():
    page, table, problems = results_page.render(ROOT)
    assert problems == []
    assert table in (ROOT / "README.md").read_text()


def test_a_curated_file_without_provenance_is_reported(repo, capsys):
    entry = results_page.ENTRIES[0]
    path = repo / "benchmarks" / "results" / entry.file
    doc = json.loads(path.read_text())
    del doc["provenance"]
    path.write_text(json.dumps(doc))
    assert results_page.main(["--check", "--root", str(repo)]) == 1
    assert f"benchmarks/results/{entry.file}: no provenance" in capsys.readouterr().err


def test_a_provenance_block_without_a_field_is_reported(repo, capsys):
    entry = results_page.ENTRIES[-1]
    path = repo / "benchmarks" / "results" / entry.file
    doc = json.loads(path.read_text())
    del doc["provenance"]["host"]["cpu_model"]
    del doc["provenance"]["argv"]
    path.write_text(json.dumps(doc))
    assert results_page.main(["--check", "--root", str(repo)]) == 1
    err = capsys.readouterr().err
    assert "provenance lacks 'argv'" in err and "provenance.host lacks 'cpu_model'" in err


def test_a_figure_that_changes_makes_the_page_stale(repo, capsys):
    entry = next(e for e in results_page.ENTRIES if e.anchor == "live-contended48")
    path = repo / "benchmarks" / "results" / entry.file
    doc = json.loads(path.read_text())
    next(r for r in doc["results"] if r["policy"] == "justitia")["promises_kept"] -= 1
    path.write_text(json.dumps(doc))
    assert results_page.main(["--check", "--root", str(repo)]) == 1
    err = capsys.readouterr().err
    assert "docs/results.md differs" in err and "README.md's results table differs" in err
    assert results_page.main(["--root", str(repo)]) == 0  # `make results` brings both in line
    capsys.readouterr()
    assert results_page.main(["--check", "--root", str(repo)]) == 0


def test_files_no_entry_names_are_left_alone(repo, capsys):
    (repo / "benchmarks" / "results" / "someone_elses_new_benchmark.json").write_text('{"rows": []}')
    assert results_page.main(["--check", "--root", str(repo)]) == 0, capsys.readouterr().err


def test_a_missing_curated_file_is_reported(repo, capsys):
    entry = results_page.ENTRIES[0]
    (repo / "benchmarks" / "results" / entry.file).unlink()
    assert results_page.main(["--check", "--root", str(repo)]) == 1
    assert f"benchmarks/results/{entry.file}: missing" in capsys.readouterr().err


@pytest.mark.parametrize(("path", "value"), [
    ("results[policy=b].x", 2),
    ("results[-1].x", 3),
    ("#results", 3),
    ("rows[density=3,share=0.5].v", "hit"),
    ("a.2x.b", 7),
])
def test_metric_paths(path, value):
    doc = {"results": [{"policy": "a", "x": 1}, {"policy": "b", "x": 2}, {"policy": "c", "x": 3}],
           "rows": [{"density": 3, "share": 0.25, "v": "miss"}, {"density": 3.0, "share": 0.5, "v": "hit"}],
           "a": {"2x": {"b": 7}}}
    assert results_page.resolve(doc, path) == value


def test_a_path_that_no_longer_resolves_says_where():
    with pytest.raises(results_page.PathError, match="no item with policy=z"):
        results_page.resolve({"results": [{"policy": "a"}]}, "results[policy=z].x")
