"""The notebooks in notebooks/ run top to bottom (test size: RAGEN_JAX_NOTEBOOK_QUICK=1) and produce their
figures and numbers; the committed copies keep their outputs small.

Each notebook runs in its own Jupyter kernel (nbclient), which inherits this process's environment: the CPU
platform and the compilation cache of conftest.py, and the quick-mode variables set here.
"""

from __future__ import annotations

import base64
import os
import re

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = os.path.join(ROOT, "notebooks")
# What GitHub and Colab show without running anything: a few small PNGs per notebook.
MAX_NOTEBOOK_BYTES = 600_000
MAX_PNG_BYTES = 150_000


def _execute(name: str, tmp_path, monkeypatch) -> nbformat.NotebookNode:
    monkeypatch.setenv("RAGEN_JAX_NOTEBOOK_QUICK", "1")
    monkeypatch.setenv("RAGEN_JAX_NOTEBOOK_DIR", str(tmp_path / "runs"))
    nb = nbformat.read(os.path.join(NOTEBOOKS, name), as_version=4)
    # A failing cell raises CellExecutionError naming the cell and its traceback.
    nbclient.NotebookClient(nb, timeout=900, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    return nb


def _text(cell) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out.output_type == "stream":
            parts.append(out.text)
        elif "text/plain" in out.get("data", {}):
            parts.append(out.data["text/plain"])
    return "".join(parts)


def _pngs(cell) -> list[bytes]:
    return [base64.b64decode(out.data["image/png"]) for out in cell.get("outputs", [])
            if "image/png" in out.get("data", {})]


def _cell(nb, source_words: str):
    """The one code cell whose source contains ``source_words``."""
    found = [c for c in nb.cells if c.cell_type == "code" and source_words in c.source]
    assert len(found) == 1, f"{len(found)} cells contain {source_words!r}"
    return found[0]


@pytest.mark.slow
def test_quickstart_runs_and_draws_its_figures(tmp_path, monkeypatch):
    nb = _execute("quickstart.ipynb", tmp_path, monkeypatch)
    assert "backend: cpu" in _text(_cell(nb, "jax.default_backend()"))
    assert re.search(r"warm start in \d+ s", _text(_cell(nb, "api.warm_start(config)")))
    assert "completed" in _text(_cell(nb, "summary = api.train"))
    assert _pngs(_cell(nb, "summary = api.train")), "the live success curve"
    assert re.search(r"train success, mean of the first 3 steps \d\.\d{3} -> last 3 \d\.\d{3}",
                     _text(_cell(nb, "first = ")))
    for words in ("before = api.load_policy", "after = api.load_policy"):
        assert "<answer>" in _text(_cell(nb, words)) or "Turn 1" in _text(_cell(nb, words))
    heatmap = _cell(nb, "api.mi_scores")
    assert _pngs(heatmap) and "retrieval_accuracy" in _text(heatmap)
    assert _pngs(_cell(nb, "filter_rows = {}"))
    exported = _text(_cell(nb, "api.export("))
    assert "config.json" in exported and "model.safetensors" in exported
    assert os.path.isfile(tmp_path / "runs" / "countdown" / "metrics.jsonl")


@pytest.mark.slow
def test_tpu_real_model_notebook_runs_on_eight_fake_devices(tmp_path, monkeypatch):
    nb = _execute("tpu_real_model.ipynb", tmp_path, monkeypatch)
    assert "8 devices" in _text(_cell(nb, "jax.devices()"))
    assert "completed" in _text(_cell(nb, "summary = api.train"))
    resumed = _text(_cell(nb, "resumed = api.train"))
    assert "resumed from step" in resumed
    assert _pngs(_cell(nb, "make_plots"))


@pytest.mark.parametrize("name", ["quickstart.ipynb", "tpu_real_model.ipynb"])
def test_committed_notebooks_have_small_outputs(name):
    path = os.path.join(NOTEBOOKS, name)
    assert os.path.getsize(path) <= MAX_NOTEBOOK_BYTES, f"{name}: clear or shrink the outputs"
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        for png in _pngs(cell) if cell.cell_type == "code" else []:
            assert len(png) <= MAX_PNG_BYTES, f"{name}: a {len(png)}-byte PNG"
