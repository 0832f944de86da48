"""experiments/results.py: runs an experiment into results/<name>/, records the command, and writes a
RESULTS.md section with its table, machine and plot; experiments not run are listed as such."""

import json
import subprocess
import sys

import pytest

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


def _results_module():
    import importlib.util
    spec = importlib.util.spec_from_file_location("results_script", REPO / "experiments" / "results.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_an_unfinished_run_carries_its_small_checkpoints_to_a_fresh_machine(tmp_path, monkeypatch):
    """--save-state keeps only the carried files (not the caches) in experiments/state/<name>; a run on a
    machine without them gets them back, without overwriting what it has; a finished run keeps none."""
    mod = _results_module()
    monkeypatch.setattr(mod, "STATE", tmp_path / "state")
    out = tmp_path / "results" / "routing"
    files = {"progress.json": b"{}", "pids.npz": b"p", "pids_random_logit.npz": b"r", "router_ICR.safetensors": b"w",
             "ckpt/router_ICR-logit.safetensors": b"c", "fv/sst2.npz": b"f", "cache/sst2.npz": b"big",
             "pid_acts/sst2.npz": b"acts", "stdout.txt": b"log"}
    for name, data in files.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(data)
    mod.save_state("routing", tmp_path / "results")
    kept = sorted(str(p.relative_to(tmp_path / "state" / "routing")) for p in (tmp_path / "state" / "routing").rglob("*")
                  if p.is_file())
    assert kept == ["ckpt/router_ICR-logit.safetensors", "fv/sst2.npz", "pids.npz", "pids_random_logit.npz",
                    "progress.json", "router_ICR.safetensors"]
    fresh = tmp_path / "fresh" / "routing"
    fresh.mkdir(parents=True)
    (fresh / "progress.json").write_bytes(b"newer")
    mod.restore_state("routing", fresh)
    assert (fresh / "progress.json").read_bytes() == b"newer"  # what the machine has wins
    assert (fresh / "ckpt" / "router_ICR-logit.safetensors").read_bytes() == b"c"
    assert not (fresh / "cache").exists() and not (fresh / "pid_acts").exists()
    # Too large to commit: refused, by size (routing has a limit of its own), and what was saved before stays.
    monkeypatch.setitem(mod.EXPERIMENTS["routing"], "state_limit", 4)
    with pytest.raises(SystemExit, match="MiB"):
        mod.save_state("routing", tmp_path / "results")
    assert (tmp_path / "state" / "routing" / "router_ICR.safetensors").read_bytes() == b"w"
    # Finished (its JSON exists): the state goes.
    monkeypatch.setitem(mod.EXPERIMENTS["routing"], "state_limit", 1 << 20)
    mod.save_state("routing", tmp_path / "results")
    (out / "routing.json").write_text("{}")
    mod.save_state("routing", tmp_path / "results")
    assert not (tmp_path / "state" / "routing").exists()
    with pytest.raises(SystemExit, match="carries no state"):
        mod.save_state("verify", tmp_path / "results")
    # Not run on this machine (a fresh clone without results/): the committed state is not wiped.
    (tmp_path / "state" / "bias_grid" / "s1").mkdir(parents=True)
    (tmp_path / "state" / "bias_grid" / "s1" / "summary.json").write_text("{}")
    mod.save_state("bias_grid", tmp_path / "results")
    assert (tmp_path / "state" / "bias_grid" / "s1" / "summary.json").exists()


def test_the_device_check_is_not_run_here_at_its_default_sizes(tmp_path):
    """Its default sizes are for a lent accelerator (minutes there, hours on 2 cores): --run says so and
    runs nothing; its section keeps what a device run measured."""
    results, out = tmp_path / "results", tmp_path / "RESULTS.md"
    cmd = [sys.executable, str(REPO / "experiments" / "results.py"), "--run", "--only", "device_check",
           "--results", str(results), "--output", str(out), "--figures", str(tmp_path / "figures")]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "runs on a lent accelerator" in run.stdout
    assert not (results / "device_check" / "device_check.json").exists()
