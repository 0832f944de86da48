"""Mutation run: apply plausible bugs to linicl one at a time and see which tests catch them.

Each mutant is a few exact string replacements in ``linicl/`` (a bug someone could plausibly write:
per-head decays reversed, the normaliser state built from rotated features, an off-by-one in a decay
exponent or a window mask, key/value heads tiled instead of repeated, ...). For each mutant the
script copies ``linicl/``, ``tests/`` and ``pyproject.toml`` of the working tree into a temporary
folder (one snapshot at the start; each mutant patches its own copy of it, the working tree is never
touched) and runs there, with ``PYTHONPATH`` set to the copy:

1. the mutant's relevant existing test files (``pytest -x -q -n 0``), then
2. ``tests/nn/test_reference.py`` (the independent NumPy reference) on its own,

and reports which test failed first in each. A replacement whose text is not found exactly as often
as expected (the source changed) is reported as ``not applied``, never run as a silent no-op. At the
end the tests that caught a mutant are run once more on the unmutated copy: a test that fails there
would be a false catch, and is flagged.

Usage (from the repository root; CPU heavy, a full run takes a while):

    .venv/bin/python tools/mutate.py                      # every mutant
    .venv/bin/python tools/mutate.py --list               # the mutants, their bugs and test files
    .venv/bin/python tools/mutate.py --only reverse-decays --only gqa-tile
    .venv/bin/python tools/mutate.py --tests tests/nn/test_model.py   # these tests instead (one phase)
    .venv/bin/python tools/mutate.py --no-reference       # only the existing tests
    .venv/bin/python tools/mutate.py --json results/mutants.json
    .venv/bin/python tools/mutate.py --set round3         # the third round's mutants (issue 25)
    .venv/bin/python tools/mutate.py --set round4 --no-reference   # the fourth round's (issue 52): sparse
                                                      # cache, GGUF K-quants, sharding, long prompts, tokenizer

The table printed at the end: mutant | caught | by test (existing files) | by test_reference.py |
seconds. ``--profile`` sets ``HYPOTHESIS_PROFILE`` (default ``ci``, the suite's own).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Optional, Sequence

REPO = pathlib.Path(__file__).resolve().parent.parent
REFERENCE = "tests/nn/test_reference.py"

# Test files, by what they check.
KERNELS = "tests/kernels/test_kernels.py"
MODEL = "tests/nn/test_model.py"
ICLCA = "tests/iclca/test_iclca.py"
FINITE = "tests/nn/test_finite_state.py"
APPROX = "tests/iclca/test_iclca_approx.py"
HF = "tests/lm/test_pretrained.py::test_logits_match_hf_transformers"


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    bug: str
    edits: tuple  # ((path, old, new, count), ...): count = how often old must occur
    tests: tuple  # the relevant existing test files (or node ids), fastest first


def _edit(path: str, old: str, new: str, count: int = 1):
    return (path, old, new, count)


ATTN, LIN, HYB = "linicl/nn/attention.py", "linicl/kernels/linear_attention.py", "linicl/kernels/hybrid_attention.py"
SOFT, POS, FMAP = "linicl/kernels/softmax_attention.py", "linicl/kernels/positions.py", "linicl/kernels/feature_maps.py"

MUTANTS = (
    Mutant("reverse-decays", "per-head decays applied in reverse head order",
           (_edit(ATTN, "jnp.log(jnp.asarray(gammas, self.cfg.jnp_dtype))",
                  "jnp.log(jnp.asarray(gammas[::-1], self.cfg.jnp_dtype))"),),
           (KERNELS, MODEL, ICLCA, FINITE)),
    Mutant("z-state-from-rotated-features", "the parallel/chunked forms build the final normaliser state z "
           "from the rotated numerator features instead of the unrotated ones",
           (_edit(LIN, "z = state.z + k_den.sum(axis=-2)", "z = state.z + k.sum(axis=-2)"),
            _edit(LIN, "(k_den * g_out[:, :, None]).sum(axis=-2)", "(k * g_out[:, :, None]).sum(axis=-2)")),
           (KERNELS, ICLCA, MODEL, FINITE)),
    Mutant("normaliser-rotated", "rope on the features also rotates the normaliser's features (every form "
           "and the state alike)",
           (_edit(ATTN, "            q_den, k_den = fq, fk\n            fq, fk = rotate(fq), rotate(fk)\n",
                  "            fq, fk = rotate(fq), rotate(fk)\n            q_den, k_den = fq, fk\n"),),
           (MODEL, ICLCA, FINITE)),
    Mutant("decay-state-age-off-by-one", "the initial state decays by gamma^t instead of gamma^(t+1) "
           "(parallel form)",
           (_edit(LIN, "g_in = _gamma_powers(log_gamma, jnp.arange(1, T + 1))",
                  "g_in = _gamma_powers(log_gamma, jnp.arange(0, T))"),),
           (KERNELS, ICLCA, MODEL, FINITE)),
    Mutant("decay-matrix-off-by-one", "the decay matrix weighs key i at query t by gamma^(t-i+1)",
           (_edit(LIN, "jnp.exp(jnp.where(causal, diff, 0)[None]", "jnp.exp(jnp.where(causal, diff + 1, 0)[None]"),),
           (KERNELS, MODEL, ICLCA, FINITE)),
    Mutant("softmax-scale-dropped", "softmax logits q.k without the 1/sqrt(d) scale (cache and full pass alike)",
           (_edit(SOFT, "scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale",
                  "scale = 1.0 if scale is None else scale"),),
           (HF, KERNELS, MODEL, APPROX)),
    Mutant("window-scale-dropped", "the hybrid's exact logits without the 1/sqrt(d) scale (every form)",
           (_edit(HYB, "jnp.einsum(\"bhtd,bhsd->bhts\", q, k) / math.sqrt(q.shape[-1])",
                  "jnp.einsum(\"bhtd,bhsd->bhts\", q, k)"),
            _edit(HYB, "scale = 1.0 / math.sqrt(q.shape[-1])", "scale = 1.0")),
           (FINITE, ICLCA, MODEL)),
    Mutant("feature-map-q-k-swapped", "a fixed feature map returns (phi(k), phi(q)): queries and keys swapped",
           (_edit(ATTN, "return phi(q), phi(k)", "return phi(k), phi(q)"),),
           (MODEL, ICLCA, FINITE)),
    Mutant("hedgehog-q-k-swapped", "hedgehog's query map is applied to the keys and the key map to the queries",
           (_edit(ATTN, "for name, x in ((\"q\", q), (\"k\", k)):", "for name, x in ((\"q\", k), (\"k\", q)):"),),
           (FINITE, ICLCA, MODEL)),
    Mutant("window-off-by-one", "the exact window holds one token more (age <= window, every form)",
           (_edit(HYB, "((c_pos < sinks)[None, :] | (age < window))", "((c_pos < sinks)[None, :] | (age <= window))"),
            _edit(HYB, "& (age >= window)", "& (age > window)"),
            _edit(HYB, "((pos < sinks) | (t - pos < window))", "((pos < sinks) | (t - pos <= window))")),
           (FINITE, ICLCA, MODEL)),
    Mutant("sinks-off-by-one", "positions <= sinks stay exact (parallel form)",
           (_edit(HYB, "((c_pos < sinks)[None, :] | (age < window))", "((c_pos <= sinks)[None, :] | (age < window))"),
            _edit(HYB, "linear = visible & (c_pos >= sinks)[None, :]", "linear = visible & (c_pos > sinks)[None, :]")),
           (FINITE, ICLCA, MODEL)),
    Mutant("window-gate-ignored", "the exact window's weight g_h = sigmoid(gate) is dropped (every form)",
           (_edit(HYB, "return jax.nn.sigmoid(gate)[:, None, None] * D * e", "return D * e"),
            _edit(HYB, "g = jax.nn.sigmoid(gate)", "g = jnp.ones_like(gate)")),
           (FINITE, ICLCA, MODEL)),
    Mutant("window-logits-unrotated", "with rope on the features the exact window scores unrotated q, k",
           (_edit(ATTN, "q_exact, k_exact = (rotate(q), rotate(k)) if rope and cfg.rope_on == \"features\" else (q, k)",
                  "q_exact, k_exact = q, k"),),
           (FINITE, ICLCA, MODEL)),
    Mutant("gqa-tile", "grouped-query heads tiled (head h reads kv head h % kv_heads) instead of repeated",
           (_edit(SOFT, "jnp.repeat(a, rep, axis=1)", "jnp.tile(a, (1, rep, 1, 1))"),),
           (HF, KERNELS, MODEL, ICLCA, APPROX)),
    Mutant("rope-styles-swapped", "the interleaved and half pairings exchanged",
           (_edit(POS, "if style == \"interleaved\":", "if style == \"half\":"),),
           (KERNELS, MODEL, ICLCA, HF)),
    Mutant("rope-odd-width", "with an odd width the frequencies use d instead of the rotated width d - 1",
           (_edit(POS, "d_rot = dim - dim % 2", "d_rot = dim"),),
           (KERNELS, MODEL, ICLCA)),
    Mutant("rebase-off-by-one", "the stored rope state is re-based by R(-(n-1)) instead of R(-n)",
           (_edit(ATTN, "rebase_state(S, n_tokens, self.cfg.rope_base",
                  "rebase_state(S, n_tokens - 1, self.cfg.rope_base"),),
           (ICLCA, MODEL, FINITE)),
    Mutant("attn-eps-dropped", "linear attention's denominator without the model's epsilon (parallel and "
           "recurrent forms)",
           (_edit(LIN, "return num / (den + eps)[..., None], LinearState(S, z)",
                  "return num / den[..., None], LinearState(S, z)"),
            _edit(LIN, "o = o / (jnp.einsum(\"bhf,bhf->bh\", qd_t, z) + eps)[..., None]",
                  "o = o / jnp.einsum(\"bhf,bhf->bh\", qd_t, z)[..., None]")),
           (KERNELS, MODEL, ICLCA)),
    Mutant("elu-without-plus-one", "the elu+1 feature map returns elu(x)",
           (_edit(FMAP, "return jax.nn.elu(x) + 1", "return jax.nn.elu(x)"),),
           (KERNELS, MODEL, ICLCA)),
    Mutant("hedgehog-sign", "hedgehog's second half is softmax(xW + b) instead of softmax(-(xW + b))",
           (_edit(FMAP, "jax.nn.softmax(-a, axis=-1)], axis=-1)", "jax.nn.softmax(a, axis=-1)], axis=-1)"),),
           (FINITE, ICLCA, MODEL)),
    Mutant("taylor2-half", "taylor2's quadratic features divided by 2 instead of sqrt(2) (1 + s + s^2/4)",
           (_edit(FMAP, "x, outer / math.sqrt(2.0)], axis=-1)", "x, outer / 2.0], axis=-1)"),),
           (KERNELS, MODEL, ICLCA)),
    Mutant("swiglu-gate-swapped", "the gated MLP computes act(fc_in(x)) * fc_gate(x)",
           (_edit("linicl/nn/block.py", "h = act(dense(cfg.d_ff, name=\"fc_gate\")(x)) * pre",
                  "h = act(pre) * dense(cfg.d_ff, name=\"fc_gate\")(x)"),),
           (HF, MODEL, ICLCA)),
    Mutant("approx-sinks-linearised-too", "convert_approx also puts the exact sink tokens into (B, b): "
           "they are counted twice",
           (_edit("linicl/iclca.py", "repeat_kv(k[:, :, sinks:], cfg.n_heads), repeat_kv(v[:, :, sinks:], cfg.n_heads)",
                  "repeat_kv(k, cfg.n_heads), repeat_kv(v, cfg.n_heads)"),),
           (APPROX,)),
)


# Round 3 (issue 25): one-line bugs beyond the kernels, in conversion, sampling, statistics,
# checkpoints, evaluation and linearization; ``--set round3`` runs them.
STATS, EVAL = "tests/evaluation/test_stats.py", "tests/evaluation/test_evaluate.py"
ROUND3 = (
    Mutant("offset-forgotten", "a second conversion forgets the first prompt's offset (the query "
           "continues at n2 instead of n1 + n2)",
           (_edit("linicl/nn/transformer.py", "offset + T if cfg.keeps_offset", "T if cfg.keeps_offset"),),
           ("tests/iclca/test_iclca.py::test_converting_twice_equals_converting_the_concatenation",
            FINITE + "::test_converting_twice_equals_converting_the_concatenation")),
    Mutant("temperature-inverted", "sampling from logits * temperature",
           (_edit("linicl/generation.py", "logits / temperature", "logits * temperature"),),
           ("tests/nn/test_sampling.py",)),
    Mutant("wilson-centre", "the Wilson interval centred on p instead of (p + z^2/2n) / (1 + z^2/n)",
           (_edit("linicl/stats.py", "centre = (p + z * z / (2 * n)) / denom", "centre = p / denom"),),
           (STATS,)),
    Mutant("recovered-unpaired", "the recovered-share bootstrap resamples zero-shot with other queries than "
           "the method",
           (_edit("linicl/stats.py", "(m[idx] - z[idx]).mean(1)", "(m[idx] - z[idx[::-1]]).mean(1)"),),
           (STATS,)),
    Mutant("checksum-without-shape", "the checkpoint content hash ignores shapes",
           (_edit("linicl/checkpoint.py", "json.dumps([name, a.dtype.name, list(a.shape)])",
                  "json.dumps([name, a.dtype.name])"),),
           ("tests/library/test_checkpoint.py",)),
    Mutant("answers-case-sensitive", "exact match compares answers without lower-casing",
           (_edit("linicl/evaluate.py", '" ".join(text.split()).lower()', '" ".join(text.split())'),),
           (EVAL,)),
    Mutant("label-argmin", "label-restricted scoring picks the least likely label",
           (_edit("linicl/evaluate.py", "pick = np.argmax(scores, axis=-1)", "pick = np.argmin(scores, axis=-1)"),),
           (EVAL,)),
    Mutant("sink-slots-shifted", "a sink token is written one slot later than its position",
           (_edit(HYB, "match = positions[None, :] == slots[:, None]", "match = positions[None, :] == slots[:, None] + 1"),),
           (FINITE, ICLCA)),
    Mutant("lora-not-merged", "the stage-2 correction is not added to the kernels (W instead of W + A B)",
           (_edit("linicl/linearize/lora.py", 'delta = (f["A"] @ f["B"]).astype(W.dtype)',
                  'delta = (0 * f["A"] @ f["B"]).astype(W.dtype)'),),
           ("tests/linearize/test_stage2.py",)),
    Mutant("nll-unshifted", "the held-out next-token loss scores each position's own token",
           (_edit("linicl/linearize/quality.py", "tokens[:, 1:, None]", "tokens[:, :-1, None]"),),
           ("tests/linearize/test_linearize.py::test_next_token_loss_by_position",)),
)

# Round 4 (issue 52): one-line bugs in the newer code: the sparse cache (LoLA), the GGUF K-quant
# dequantisers, the sharding rules, the long-prompt builders and the tokenizer; ``--set round4`` runs
# them (``--no-reference``: the NumPy reference is about the model kernels, none of these is there).
SPARSE, SPARSE_MODEL = "linicl/kernels/sparse_cache.py", "tests/nn/test_sparse_cache_model.py"
SPARSE_TESTS = "tests/kernels/test_sparse_cache.py"
GGUF, PARALLEL, LONG, TOKENIZER = ("linicl/lm/gguf.py", "linicl/parallel.py", "linicl/data/long_context.py",
                                   "linicl/lm/tokenizer.py")
GGUF_TESTS, TOKENIZER_TESTS = "tests/lm/test_gguf.py", "tests/lm/test_tokenizer.py"
LONG_TESTS = "tests/data/test_long_context.py"
SHARDING, SHARDING_INPUTS = "tests/library/test_sharding.py", "tests/library/test_sharding_inputs.py"
ROUND4 = (
    Mutant("cache-evicts-highest", "of the cached tokens and the candidate, the highest score leaves for the "
           "linear state (the cache keeps what the state recalls best)",
           (_edit(SPARSE, "lowest = score == score.min(-1, keepdims=True)",
                  "lowest = score == score.max(-1, keepdims=True)"),),
           (SPARSE_TESTS, SPARSE_MODEL)),
    Mutant("cache-slot-pos-not-rewritten", "a candidate that replaces a cached token leaves that token's "
           "position in the slot (positions written into empty slots only)",
           (_edit(SPARSE, "new_pos = jnp.where(put, c_pos[..., None], pos)",
                  "new_pos = jnp.where(put & (pos < 0), c_pos[..., None], pos)"),),
           (SPARSE_TESTS, SPARSE_MODEL)),
    Mutant("cache-leave-decay-off-by-one", "a token leaving for (S, z) is weighted gamma^(t - i + 1)",
           (_edit(SPARSE, "w = _powers(gamma, t - jnp.broadcast_to(pos, (B, H)), leaves, S.dtype)",
                  "w = _powers(gamma, t - jnp.broadcast_to(pos, (B, H)) + 1, leaves, S.dtype)"),),
           (SPARSE_TESTS, SPARSE_MODEL)),
    Mutant("q4k-min-sign", "Q4_K adds the sub-block minimum (x = d sc q + dmin m) instead of subtracting it",
           (_edit(GGUF, "return (scale * q - shift).reshape(-1, 256)", "return (scale * q + shift).reshape(-1, 256)"),),
           (GGUF_TESTS,)),
    Mutant("q4k-min-high-bits-from-scale-bytes", "Q4_K's minima 4-7 take their top two bits from the scale "
           "bytes 0-3 instead of the minimum bytes 4-7",
           (_edit(GGUF, "(s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)", "(s[:, 8:12] >> 4) | ((s[:, 0:4] >> 6) << 4)"),),
           (GGUF_TESTS,)),
    Mutant("q6k-scales-unsigned", "Q6_K's 16 sub-block scales read as unsigned bytes (a negative scale "
           "becomes 256 + s)",
           (_edit(GGUF, '("scales", "i1", 16)', '("scales", "u1", 16)'),),
           (GGUF_TESTS,)),
    Mutant("shard-o-kernel-wrong-axis", "the rule for attn/o/kernel [heads, d_head, d_model] splits d_head "
           "over \"model\" instead of the heads",
           (_edit(PARALLEL, '(r"attn/o/kernel$", 0),', '(r"attn/o/kernel$", 1),'),),
           (SHARDING + "::test_the_rules_split_heads_columns_and_vocabulary", SHARDING)),
    Mutant("batch-over-model-axis", "shard_batch splits the batch over every mesh axis (\"data\" and "
           "\"model\") instead of \"data\" alone",
           (_edit(PARALLEL, "NamedSharding(mesh, PartitionSpec(DATA_AXIS))",
                  "NamedSharding(mesh, PartitionSpec(tuple(mesh.axis_names)))"),),
           (SHARDING_INPUTS, SHARDING)),
    Mutant("key-depth-truncated", "the passkey line after int(depth * budget) filler tokens (truncated, "
           "not rounded)",
           (_edit(LONG, "before = int(round(depth * budget))", "before = int(depth * budget)"),),
           (LONG_TESTS,)),
    Mutant("key-answered-prefix", "key_answered accepts an answer whose first number is a prefix of the key",
           (_edit(LONG, "return digits is not None and digits.group() == key",
                  "return digits is not None and key.startswith(digits.group())"),),
           (LONG_TESTS,)),
    Mutant("bos-default-inverted", "encode(text) adds BOS exactly where the checkpoint says not to",
           (_edit(TOKENIZER, "if self.adds_bos if add_bos is None else add_bos:",
                  "if (not self.adds_bos) if add_bos is None else add_bos:"),),
           (TOKENIZER_TESTS,)),
    Mutant("no-byte-fallback", "Gemma's SentencePiece without byte fallback (a character with no piece "
           "becomes <unk>)",
           (_edit(TOKENIZER, 'unk_token="<unk>", fuse_unk=True, byte_fallback=True)',
                  'unk_token="<unk>", fuse_unk=True, byte_fallback=False)'),),
           (TOKENIZER_TESTS,)),
    Mutant("sp-merge-split-off-by-one", "SentencePiece merges enumerate splits cut = len - 1 .. 2: no merge "
           "with a one-character left part",
           (_edit(TOKENIZER, "for cut in range(len(p) - 1, 0, -1)", "for cut in range(len(p) - 1, 1, -1)"),),
           (TOKENIZER_TESTS,)),
)
SETS = {"round1-2": MUTANTS, "round3": ROUND3, "round4": ROUND4}


# ------------------------------------------------------------------------------ the copy and the run
def _copy_tree(dest: pathlib.Path, source: pathlib.Path = REPO) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache", ".hypothesis")
    for name in ("linicl", "tests"):
        shutil.copytree(source / name, dest / name, ignore=ignore)
    shutil.copy2(source / "pyproject.toml", dest / "pyproject.toml")


def _apply(dest: pathlib.Path, mutant: Mutant) -> Optional[str]:
    """Patch the copy; returns None, or why a replacement could not be made exactly."""
    for path, old, new, count in mutant.edits:
        file = dest / path
        text = file.read_text()
        found = text.count(old)
        if found != count:
            return f"{path}: expected {count} occurrence(s) of {old!r}, found {found}"
        file.write_text(text.replace(old, new))
    return None


@dataclasses.dataclass
class Run:
    failed: Optional[str]  # the first failing test (node id), or a reason; None when all passed
    seconds: float
    returncode: int
    tail: str


# A summary line "FAILED path::test[param id] - message": the node id whole, a parameter id with
# spaces included (e.g. "[The capital of France is-ids0]"), without the message.
_SUMMARY = re.compile(r"^(FAILED|ERROR) ([^\s\[]+(?:\[.*?\])?)(?: - |$)")


def _summary_ids(output: str) -> list:
    """``(kind, node id)`` of every FAILED / ERROR line of pytest's short summary, in order."""
    return [m.groups() for m in map(_SUMMARY.match, output.splitlines()) if m]


def _first_failure(output: str, returncode: int) -> Optional[str]:
    if returncode == 0:
        return None
    for kind, node in _summary_ids(output):
        return node if kind == "FAILED" else f"error: {node}"
    if returncode == 5:
        return "no tests collected"
    return f"pytest exit {returncode}"


def _pytest(dest: pathlib.Path, tests: Sequence[str], env: dict, timeout: float, stop: bool = True) -> Run:
    # --keep-duplicates: a node id listed before its own file runs first (pytest would otherwise
    # merge the two into the file's order, and "fastest first" would not hold).
    cmd = [sys.executable, "-m", "pytest", *tests, "-q", "-n", "0", "-p", "no:cacheprovider",
           "--keep-duplicates", "--rootdir", str(dest)] + (["-x"] if stop else [])
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=dest, env=env, capture_output=True, text=True, timeout=timeout)
        output, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        output = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return Run(f"timeout after {timeout:.0f} s", time.monotonic() - start, -1, output[-2000:])
    return Run(_first_failure(output, code), time.monotonic() - start, code, output[-2000:])


def _env(dest: pathlib.Path, profile: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(dest) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["HYPOTHESIS_PROFILE"] = profile
    return env


def _check_imports_copy(dest: pathlib.Path, env: dict) -> None:
    """The copy, not the editable install of the working tree, must be what the tests import."""
    out = subprocess.run([sys.executable, "-c", "import linicl; print(linicl.__file__)"], cwd=dest, env=env,
                         capture_output=True, text=True, check=True).stdout.strip()
    if not pathlib.Path(out).resolve().is_relative_to(dest.resolve()):
        sys.exit(f"mutate.py: the tests would import linicl from {out}, not from the copy in {dest}")


# ------------------------------------------------------------------------------ main
def _select(names: Sequence[str], mutants: Sequence[Mutant] = MUTANTS) -> list:
    if not names:
        return list(mutants)
    known = {m.name: m for m in mutants}
    unknown = [n for n in names if n not in known]
    if unknown:
        sys.exit(f"mutate.py: unknown mutant(s) {unknown}; --list shows them")
    return [known[n] for n in names]


def _table(rows: list, with_reference: bool) -> str:
    head = ["mutant", "caught", "by test" + (" (existing files)" if with_reference else ""),
            *(["by " + REFERENCE] if with_reference else []), "seconds"]
    body = [[r["mutant"], r["caught"], r["by_test"] or "-", *([r["by_reference"] or "-"] if with_reference else []),
             f"{r['seconds']:.0f}"] for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    fmt = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([fmt(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(fmt, body)])


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--set", choices=list(SETS), default="round1-2", help="which mutants (default round1-2)")
    parser.add_argument("--only", action="append", default=[], metavar="NAME", help="run only this mutant (repeatable)")
    parser.add_argument("--tests", nargs="+", metavar="PATH", help="run these test files/node ids for every "
                        "mutant instead of its relevant files and the reference (one phase)")
    parser.add_argument("--no-reference", action="store_true", help=f"skip the {REFERENCE} phase")
    parser.add_argument("--no-baseline", action="store_true", help="skip re-running the catching tests unmutated")
    parser.add_argument("--profile", default="ci", help="HYPOTHESIS_PROFILE for the runs (default: ci)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per pytest run (default 3600)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--keep", action="store_true", help="keep the temporary copies")
    args = parser.parse_args(argv)
    mutants = _select(args.only, SETS[args.set])
    if args.list:
        for m in mutants:
            print(f"{m.name}: {m.bug}\n    edits: {', '.join(sorted({e[0] for e in m.edits}))}\n"
                  f"    tests: {' '.join(m.tests)}")
        return 0
    with_reference = not args.no_reference and not args.tests
    root = pathlib.Path(tempfile.mkdtemp(prefix="linicl-mutants-"))
    rows = []
    try:
        # One snapshot of the working tree: every mutant starts from it, whatever changes meanwhile.
        clean = root / "unmutated"
        _copy_tree(clean)
        _check_imports_copy(clean, _env(clean, args.profile))
        for m in mutants:
            dest = root / m.name
            _copy_tree(dest, clean)
            env = _env(dest, args.profile)
            problem = _apply(dest, m)
            row = dict(mutant=m.name, bug=m.bug, caught="not applied", by_test=problem, by_reference=None,
                       seconds=0.0)
            if problem is None:
                first = _pytest(dest, args.tests or m.tests, env, args.timeout)
                ref = _pytest(dest, [REFERENCE], env, args.timeout) if with_reference else None
                row.update(by_test=first.failed, by_reference=ref and ref.failed,
                           seconds=first.seconds + (ref.seconds if ref else 0.0),
                           caught="yes" if first.failed or (ref and ref.failed) else "NO")
            rows.append(row)
            print(f"[{len(rows)}/{len(mutants)}] {m.name}: caught={row['caught']} by={row['by_test']} "
                  f"reference={row['by_reference']} ({row['seconds']:.0f} s)", flush=True)
            if not args.keep:
                shutil.rmtree(dest, ignore_errors=True)
        if not args.no_baseline:
            _baseline(rows, clean, _env(clean, args.profile), args.timeout)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print()
    print(_table(rows, with_reference))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0 if all(r["caught"] == "yes" for r in rows) else 1


def _baseline(rows: list, clean: pathlib.Path, env: dict, timeout: float) -> None:
    """Re-run every catching test on the unmutated copy; flag the catches of tests that fail there."""
    node = lambda caught: caught.removeprefix("error: ")  # noqa: E731  (a test that errored: its id)
    ids = sorted({node(r[k]) for r in rows for k in ("by_test", "by_reference")
                  if r[k] and "::" in r[k] and not r[k].startswith("timeout")})
    if not ids:
        return
    run = _pytest(clean, ids, env, timeout, stop=False)
    if run.returncode == 0:
        print(f"baseline: the {len(ids)} catching tests pass on the unmutated copy")
        return
    bad = {n for _, n in _summary_ids(run.tail)}
    if not bad:
        print(f"baseline: the catching tests could not be run on the unmutated copy (pytest exit "
              f"{run.returncode}); their catches are unchecked:\n{run.tail}")
        return
    print(f"baseline: these tests FAIL on the unmutated copy too (their catches are not evidence): {sorted(bad)}")
    for r in rows:
        for k in ("by_test", "by_reference"):
            if r[k] and node(r[k]) in bad:
                r[k] += " (fails unmutated!)"
        if r["caught"] == "yes" and not any(r[k] and "::" in r[k] and not r[k].endswith("unmutated!)")
                                            for k in ("by_test", "by_reference")):
            r["caught"] = "unclear"


if __name__ == "__main__":
    sys.exit(main())
