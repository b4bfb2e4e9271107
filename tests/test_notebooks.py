"""The notebooks run top to bottom (nbclient), so they cannot rot.

Each notebook pins numbers with `assert` cells and prints "checks pass" after
them; a notebook that ran but skipped its checks fails here. The committed
files carry no outputs, and the notebooks import only public rljax names.
"""

import os
import pathlib
import re

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 300


def test_the_three_notebooks_exist():
    names = {p.name for p in NOTEBOOKS}
    assert {"token_weights.ipynb", "trust_regions.ipynb", "inspect_run.ipynb"} <= names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_without_outputs_and_public_imports_only(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.outputs == [] and c.execution_count is None for c in code), \
        f"{path.name}: clear the outputs before committing"
    for c in code:
        # A private module or name (rljax._checks, rljax.x._y) is not API.
        assert not re.search(r"\brljax(\.\w+)*\._", c.source), c.source
    assert any("assert " in c.source for c in code), f"{path.name} checks nothing"


@pytest.fixture(scope="module")
def kernel_env(tmp_path_factory):
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               # inline: figures become image/png outputs, no display needed
               MPLBACKEND="module://matplotlib_inline.backend_inline",
               # shared with test_sweep: the toy trainer compiles once per session
               JAX_COMPILATION_CACHE_DIR=str(tmp_path_factory.getbasetemp() / "jax_cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    env.pop("RLJAX_RUN_DIR", None)  # inspect_run trains its own toy run
    return env


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_and_its_checks_pass(path, kernel_env):
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT)}})
    client.execute(env=kernel_env)  # raises CellExecutionError on any error
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "checks pass" in text, f"{path.name} never reached its checks"
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert images, f"{path.name} drew no figure"
