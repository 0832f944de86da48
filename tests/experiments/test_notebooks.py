"""Every notebook in notebooks/ runs top to bottom without an error (outputs are not committed)."""


import nbformat
import pytest
from nbclient import NotebookClient
from helpers import REPO

NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
@pytest.mark.usefixtures("data_env")  # their data parts read the full data sets, else the committed sample
def test_notebook_runs(path, tmp_path):
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
