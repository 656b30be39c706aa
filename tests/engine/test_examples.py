"""The notebook and the tool-calling example, run against the real server and engine."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_notebook_executes(vllm_server, monkeypatch) -> None:
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("JUSTITIA_URL", vllm_server.url)
    nb = nbformat.read(EXAMPLES / "notebook.ipynb", as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(EXAMPLES)}}).execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    html = "\n".join(o.get("data", {}).get("text/html", "") for o in outputs)
    # The live tables (display updates end on the final table) and the batch's own repr.
    assert "notebook_summary" in html and "fact_verification" in html and "kept" in html
    texts = "\n".join(o.get("data", {}).get("text/plain", "") for o in outputs)
    assert "ValueError('no notes to summarize')" in texts


def test_the_tool_calling_example_runs_against_the_server(vllm_server) -> None:
    proc = subprocess.run([sys.executable, str(EXAMPLES / "tool_calling.py"), "--url", vllm_server.url],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "the model called get_weather(" in proc.stdout
    assert "the Agents SDK's agent answered: 'sunny in " in proc.stdout
