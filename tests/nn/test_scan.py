"""``Transformer(cfg, scan=True)``: the blocks run by ``jax.lax.scan`` over whole periods of equal layers
give the loop's logits and gradients (float64, to the exact tolerance; remat on and off), keep every
variable path, fall back to the loop where a scan could not be exact, and do scan: the traced program of
an 8-layer model is about as long as a 2-layer one's, while the loop's grows with depth."""

import collections
import functools

import jax
import jax.numpy as jnp
import pytest

import linicl
from linicl import iclca
from linicl.errors import LiniclError
from linicl.interventions import capture, scale, with_edits, zero
from linicl.names import DECODE
from linicl.nn.transformer import period_of, scan_segments
from helpers import BASELINE_MIN, EXACT_RTOL, apply, init, rel_err, tokens

_GEMMA = dict(vocab_size=23, d_model=16, n_heads=4, n_kv_heads=2, d_ff=24, max_len=64, positions="rope",
              rope_style="half", norm="sandwich", norm_type="gemma_rmsnorm", qk_norm=True, mlp="gated",
              activation="gelu_tanh", use_bias=False, sliding_window=3, rope_local_base=100.0,
              dtype="float64")
# Local, global, local, global, local: period 2, two whole periods scanned and one layer looped.
_PATTERN = ("local", "global") * 2 + ("local",)
CONFIGS = {
    "llama": linicl.preset("tiny-llama", dtype="float64", n_layers=2),
    "gemma3": linicl.ModelConfig(attention="softmax", n_layers=5, layer_types=_PATTERN, **_GEMMA),
    "linear": linicl.preset("tiny-linear", dtype="float64", n_layers=2),
    "short_conv": linicl.preset("tiny-linear-rope-decay", dtype="float64", n_layers=2, short_conv=3,
                                short_conv_activation="silu"),
}


def _flat(tree) -> jax.Array:
    return jnp.concatenate([a.ravel() for a in jax.tree.leaves(tree)])


@functools.lru_cache(maxsize=None)
def _jitted_grad(model):
    loss = lambda p, x: jnp.sum(jnp.tanh(model.apply({"params": p}, x)))  # noqa: E731
    return jax.jit(jax.grad(loss))


def _grad(model, variables, x) -> jax.Array:
    """The gradient of a scalar of the logits w.r.t. the parameters, flattened (one compile a model)."""
    return _flat(_jitted_grad(model)(variables["params"], x))


def _top_scans(model, variables, *args, **kwargs) -> list:
    """The lengths of the top-level ``scan`` equations of a forward's jaxpr (a scanned model has one
    of length n_periods that the loop lacks; a kernel's own scans move into its body)."""
    jaxpr = jax.make_jaxpr(lambda v: model.apply(v, *args, **kwargs))(variables).jaxpr
    return sorted(e.params["length"] for e in jaxpr.eqns if e.primitive.name == "scan")


def _extra_scans(model, variables, *args, **kwargs) -> list:
    scanned = _top_scans(model.clone(scan=True), variables, *args, **kwargs)
    looped = _top_scans(model, variables, *args, **kwargs)
    return sorted((collections.Counter(scanned) - collections.Counter(looped)).elements())


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_scanned_blocks_give_the_loops_logits_and_gradients(name):
    """Logits and parameter gradients, scanned with and without remat, equal the loop's; the parameter
    tree is the loop's; power: another input's gradient is far off."""
    cfg = CONFIGS[name]
    model, variables = init(cfg, 1)
    x, other = tokens(2, 2, 9, cfg.vocab_size), tokens(3, 2, 9, cfg.vocab_size)
    scanned, both = model.clone(scan=True), model.clone(scan=True, remat=True)
    shapes = jax.eval_shape(scanned.init, jax.random.PRNGKey(0), x)  # init loops: the same tree
    assert jax.tree.structure(shapes) == jax.tree.structure(variables)
    logits = apply(model, variables, x)
    assert rel_err(apply(scanned, variables, x), logits) <= EXACT_RTOL
    assert _extra_scans(model, variables, x) == [cfg.n_layers // (2 if name == "gemma3" else 1)]
    g = _grad(model, variables, x)
    assert rel_err(_grad(scanned, variables, x), g) <= EXACT_RTOL
    assert rel_err(_grad(both, variables, x), g) <= EXACT_RTOL
    assert rel_err(_grad(model, variables, other), g) >= BASELINE_MIN


def test_a_converted_model_reads_its_prompt_state_scanned():
    """``iclca.convert``'s variables (per-layer prompt states, local windows, the position offset) in a
    linear model with Gemma-style local layers (rope on the inputs, as local layers need): the scanned
    query equals the looped one."""
    cfg = CONFIGS["gemma3"].replace(attention="linear", feature_map="elu+1", rope_on="inputs")
    model, variables = init(cfg, 4)
    converted = iclca.convert(model, variables, tokens(5, 1, 6, cfg.vocab_size))
    q = tokens(6, 2, 5, cfg.vocab_size)
    looped = apply(model, converted, q)
    assert rel_err(apply(model.clone(scan=True), converted, q), looped) <= EXACT_RTOL
    assert _extra_scans(model, converted, q) == [2]  # two periods (local, global) and a looped layer
    assert rel_err(apply(model, variables, q), looped) >= BASELINE_MIN  # the prompt matters


def test_first_layer_scans_what_is_left_and_loops_when_too_little_is():
    """``first_layer`` 1 leaves two periods of the 5-layer pattern (scanned); 2 leaves fewer (looped);
    both equal the loop."""
    cfg = CONFIGS["gemma3"]
    model, variables = init(cfg, 7)
    h = jax.random.normal(jax.random.PRNGKey(8), (2, 6, cfg.d_model), jnp.float64)
    for first, scans in ((1, [2]), (2, [])):
        run = lambda m: jax.jit(lambda v, e: m.apply(v, embeds=e, first_layer=first))(variables, h)  # noqa: E731
        assert rel_err(run(model.clone(scan=True)), run(model)) <= EXACT_RTOL
        assert _extra_scans(model, variables, embeds=h, first_layer=first) == scans


def test_captured_sites_and_the_decode_cache_scan_as_the_loop_writes_them():
    """Mutable collections scan: captured sites and the decode cache (a prefill, then a decoded
    token from that cache) equal the loop's, under the same paths; the forwards do scan."""
    cfg = CONFIGS["llama"]
    model, variables = init(cfg, 9)
    scanned = model.clone(scan=True)
    x = tokens(10, 2, 6, cfg.vocab_size)
    name = "blocks.1.hook_resid_post"
    (_, ours), (_, loops) = capture(scanned, variables, x), capture(model, variables, x)
    assert sorted(ours) == sorted(loops)
    assert rel_err(ours[name], loops[name]) <= EXACT_RTOL
    assert _extra_scans(model, variables, x, mutable=["intermediates"]) == [2]
    step = lambda m: jax.jit(lambda v, t: m.apply(v, t, mutable=[DECODE]))  # noqa: E731
    (a, sa), (b, sb) = step(model)(variables, x), step(scanned)(variables, x)
    assert jax.tree.structure(sb) == jax.tree.structure(sa)
    assert rel_err(b, a) <= EXACT_RTOL and rel_err(_flat(sb), _flat(sa)) <= EXACT_RTOL
    nxt = tokens(11, 2, 1, cfg.vocab_size)
    (a, sa), (b, sb) = step(model)({**variables, **sa}, nxt), step(scanned)({**variables, **sb}, nxt)
    assert rel_err(b, a) <= EXACT_RTOL and rel_err(_flat(sb), _flat(sa)) <= EXACT_RTOL
    assert rel_err(a, apply(model, variables, nxt)[:, -1:]) >= BASELINE_MIN  # the cache matters
    assert _extra_scans(model, variables, x, mutable=[DECODE]) == [2]


def test_a_prompt_converts_scanned_as_looped():
    """``iclca.convert`` writes each layer's prompt state (a mutable collection) from the scan: the
    same states, and the same answers to a query, as the loop."""
    cfg = CONFIGS["short_conv"]
    model, variables = init(cfg, 12)
    prompt, q = tokens(13, 1, 7, cfg.vocab_size), tokens(14, 2, 4, cfg.vocab_size)
    ours, loops = iclca.convert(model.clone(scan=True), variables, prompt), iclca.convert(model, variables, prompt)
    assert jax.tree.structure(ours) == jax.tree.structure(loops)
    assert rel_err(_flat(ours["prompt_state"]), _flat(loops["prompt_state"])) <= EXACT_RTOL
    assert rel_err(apply(model, ours, q), apply(model, loops, q)) <= EXACT_RTOL
    assert rel_err(apply(model, variables, q), apply(model, loops, q)) >= BASELINE_MIN


def test_edits_scan_when_every_layer_has_the_same_kind_and_split_the_scan_otherwise():
    """Edits of one kind at one site of every layer are stacked and scanned; an edit in layer 0 of 3
    loops that layer and scans the other two; edits outside the blocks (``hook_embed``) are applied
    by the model itself. Every case gives the loop's logits, and the edits change them (power)."""
    cfg = CONFIGS["llama"].replace(n_layers=3)
    model, variables = init(cfg, 9)
    scanned = model.clone(scan=True)
    x = tokens(10, 2, 6, cfg.vocab_size)
    every = with_edits(variables, [scale(f"blocks.{l}.hook_mlp_out", 0.5 + l) for l in range(cfg.n_layers)], cfg)
    some = with_edits(variables, [zero("blocks.0.hook_mlp_out")], cfg)
    outside = with_edits(variables, [scale("hook_embed", 2.0)], cfg)
    for edited, scans in ((every, [3]), (some, [2]), (outside, [3])):
        assert rel_err(apply(scanned, edited, x), apply(model, edited, x)) <= EXACT_RTOL
        assert rel_err(apply(model, edited, x), apply(model, variables, x)) >= BASELINE_MIN
        assert _extra_scans(model, edited, x) == scans


def test_remat_checkpoints_the_scanned_step():
    """``scan=True, remat=True``: the gradient's program holds the checkpointed step (the equality of
    its gradients is tested above)."""
    cfg = CONFIGS["llama"]
    model, variables = init(cfg, 11)
    x = tokens(12, 1, 4, cfg.vocab_size)
    traced = lambda m: str(jax.make_jaxpr(jax.grad(lambda p: m.apply({"params": p}, x).sum()))(variables["params"]))  # noqa: E731
    assert "remat" in traced(model.clone(scan=True, remat=True))
    assert "remat" not in traced(model.clone(scan=True))


def _n_equations(jaxpr) -> int:
    """Equations of a jaxpr, counting those of every sub-jaxpr (a scan's body, a jit's) once."""
    total = 0
    for eqn in jaxpr.eqns:
        total += 1
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    total += _n_equations(inner)
    return total


def test_the_scanned_program_does_not_grow_with_depth():
    """Deterministic size check (no timing): an 8-layer scanned forward traces to about as many
    equations as a 2-layer one (within 1.5x: only the stacking of each layer's variables grows),
    the unrolled 8-layer one to at least 2.5x."""
    x = jnp.zeros((1, 4), jnp.int32)

    def size(n_layers: int, scan: bool) -> int:
        model = linicl.Transformer(CONFIGS["llama"].replace(n_layers=n_layers), scan=scan)
        shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0), x)
        return _n_equations(jax.make_jaxpr(model.apply)(shapes, x).jaxpr)

    scan2, scan8, loop2, loop8 = size(2, True), size(8, True), size(2, False), size(8, False)
    assert scan8 <= 1.5 * scan2, (scan2, scan8)
    assert loop8 >= 2.5 * loop2, (loop2, loop8)


def test_period_of_finds_the_smallest_repeating_pattern():
    assert period_of("aaaa") == 1
    assert period_of("llgllg") == 3
    assert period_of("llgllgl") == 3  # a remainder of one layer
    assert period_of("llgll") is None  # fewer than two whole periods
    assert period_of("ab") == period_of("a") is None and period_of("") is None


def test_scan_segments_scan_the_longest_runs_and_loop_between_them():
    assert scan_segments("aaaa") == [(0, 1, 4)]
    assert scan_segments("llgllgl") == [(0, 3, 2)]  # Gemma 3's pattern: the last layer loops
    assert scan_segments("aabaa") == [(0, 1, 2), (3, 1, 2)]  # an edit in the middle layer
    assert scan_segments("abaaa") == [(2, 1, 3)]
    assert scan_segments("ab") == scan_segments("abc") == []


def test_an_edit_in_one_middle_layer_scans_the_runs_around_it():
    """Five layers with an edit in layer 2: layers 0-1 and 3-4 scan, layer 2 loops; the loop's
    logits, with and without a decode cache."""
    cfg = CONFIGS["llama"].replace(n_layers=5)
    model, variables = init(cfg, 15)
    x = tokens(16, 2, 5, cfg.vocab_size)
    edited = with_edits(variables, [scale("blocks.2.hook_resid_post", 3.0)], cfg)
    assert rel_err(apply(model.clone(scan=True), edited, x), apply(model, edited, x)) <= EXACT_RTOL
    assert rel_err(apply(model, edited, x), apply(model, variables, x)) >= BASELINE_MIN
    assert _extra_scans(model, edited, x) == [2, 2]
    step = lambda m: jax.jit(lambda v, t: m.apply(v, t, mutable=[DECODE]))  # noqa: E731
    (a, sa), (b, sb) = step(model)(edited, x), step(model.clone(scan=True))(edited, x)
    assert rel_err(b, a) <= EXACT_RTOL and rel_err(_flat(sb), _flat(sa)) <= EXACT_RTOL


def test_scan_must_be_a_bool():
    cfg = CONFIGS["linear"]
    with pytest.raises(LiniclError, match="scan must be a bool"):
        linicl.Transformer(cfg, scan="yes").init(jax.random.PRNGKey(0), jnp.zeros((1, 2), jnp.int32))
