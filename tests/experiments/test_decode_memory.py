"""experiments/benchmarks/decode_memory.py measures the decode state of a model with local layers: on
the tiny Gemma 3 fixture (window 4, layers local, local, global) the local layers hold 3 keys at 16
and at 64 tokens, the global layer its max_len cache."""

from __future__ import annotations

import json

from helpers import REPO, load_module

SCRIPT = REPO / "experiments" / "benchmarks" / "decode_memory.py"


def test_quick_run_counts_each_layer_s_decode_state(tmp_path):
    bench = load_module(SCRIPT, "decode_memory")
    assert bench.main(["--quick", "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "decode_memory.json").read_text())
    assert r["local_bounded"] and r["local_keys"] == [3] and r["tokens"] == 64
    # tiny Gemma 3: 4 query heads of 24, 2 kv heads; local: (window - 1) * kv heads * (key 24 + value
    # 24), (window - 1) * heads * 2 features of 1, plus the (zero) linear state of the window-only
    # hybrid, S and z of one feature per query head (iclca.state_floats)
    per_local = 3 * 2 * (24 + 24) + 3 * 4 * 2 + 4 * (24 + 1)
    assert [x["floats"] for x in r["layers"]] == [per_local, per_local, 2 * 2 * 24 * 64]
    assert r["kv_cache_floats"] == 2 * 2 * 24 * (3 + 3 + 64) and r["all_global_kv_floats"] == 2 * 2 * 24 * 64 * 3
    assert r["local_kv_floats"] == 2 * 2 * 24 * 3 * 2
