"""experiments/results.py: runs an experiment into results/<name>/, records the command, and writes a
RESULTS.md section with its table, machine and plot; experiments not run are listed as such."""

import json
import subprocess
import sys

from helpers import REPO


def test_results_runs_one_experiment_and_writes_its_section(tmp_path):
    results, out, figures = tmp_path / "results", tmp_path / "RESULTS.md", tmp_path / "figures"
    cmd = [sys.executable, str(REPO / "experiments" / "results.py"), "--run", "--quick", "--only", "implicit_dherin",
           "--results", str(results), "--output", str(out), "--figures", str(figures)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    record = json.loads((results / "implicit_dherin" / "run.json").read_text())
    assert record["exit_code"] == 0 and record["quick"] and "implicit_dherin.py --quick" in record["command"]
    text = out.read_text()
    section = text.split("## Dherin et al.")[1].split("\n## ")[0]
    assert "quick mode" in section and "held-out loss" in section and "machine:" in section
    assert "Not run yet" in text.split("## Exact conversion")[1].split("\n## ")[0]  # verify was not run
    # A second call does not run it again.
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert "result exists" in again.stdout


def test_a_checkout_without_results_keeps_the_measured_sections(tmp_path):
    """results/ is not committed: rewriting RESULTS.md from an empty results folder keeps every measured
    section as it is (byte for byte) and lists only what was never measured as not run."""
    out = tmp_path / "RESULTS.md"
    out.write_text((REPO / "RESULTS.md").read_text())
    cmd = [sys.executable, str(REPO / "experiments" / "results.py"), "--results", str(tmp_path / "none"),
           "--output", str(out), "--figures", str(tmp_path / "figures")]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert out.read_text() == (REPO / "RESULTS.md").read_text()
    # A file with no measured sections reads "Not run yet" everywhere, as before.
    out.write_text("# Results\n")
    subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True)
    assert out.read_text().count("Not run yet") == len(out.read_text().split("\n## ")) - 1
