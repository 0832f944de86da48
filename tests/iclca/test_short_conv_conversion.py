"""ICLCA with a short causal convolution of q, k, v (``ModelConfig.short_conv``): the conversion stays
exact on every linear form (additive, decayed, gated, delta rule, the window/sinks hybrid, its sparse
cache, linear global layers among local ones), prompts shorter than K - 1 included; the convolution's
stored state matters (zeroing it is far off); converting twice is converting the concatenation; a
decode token by token, from a fresh or a converted model, is the full forward; generation after a
conversion is generation after the prompt; bad configs and foreign states are refused.

As in ``test_gated_delta_conversion.py`` most tests run a fixed list of families, each with one jitted
program, so that hypothesis spends its examples on parameters and tokens; one test draws its configs
from the shared strategies (``finite_state_configs``) with a convolution added. The taps are random
(``perturb_taps``): the identity init would make the convolution a no-op and these tests powerless.
"""

import os
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import linicl
from linicl import iclca, implicit
from linicl.errors import ConfigError, LiniclError, NotExactError
from linicl.memory import prompt_floats
from linicl.names import DECODE, FORMS, PROMPT_STATE, SHORT_CONV_STATE
from helpers import (BASELINE_MIN, EXACT_RTOL, OFFSET_FAMILIES, assert_same_state, finite_state_configs,
                     init, perturb_learned_maps, prompt_and_query, rel_err, tokens)

THOROUGH = os.environ.get("HYPOTHESIS_PROFILE") == "thorough"
N_EXAMPLES = 50 if THOROUGH else 1
QUERY_LEN, BATCH, SECOND = 5, 2, 3  # query tokens, query batch, length of the second prompt

_BASE = dict(vocab_size=24, d_model=12, n_layers=2, n_heads=3, d_ff=8, max_len=64, attention="linear",
             dtype="float64")
# (config, prompt lengths): every linear form with K in {2, 3, 4} and both activations; each family
# has a prompt shorter than K - 1 where K > 2 (the fresh zeros and the earlier state shift in).
FAMILIES = [
    # plain additive: feature maps, normalised or not, decay, every position handling
    (dict(short_conv=2, feature_map="elu+1", positions="none", n_kv_heads=1, n_layers=1), (1, 5)),
    (dict(short_conv=4, short_conv_activation="silu", feature_map="identity", normalize=False, decay=0.9,
          positions="rope", rope_on="features", form="chunked", chunk_size=2), (2, 6)),
    (dict(short_conv=3, feature_map="taylor2", d_model=9, positions="learned", norm="post",
          trainable_bias=True, form="recurrent"), (1, 5)),
    (dict(short_conv=4, short_conv_activation="silu", feature_map="relu", attn_eps=1e-3,
          decay=(0.8, 0.9, 1.0), positions="rope", rope_on="inputs", rope_style="half", n_layers=1), (1, 7)),
    (dict(short_conv=3, short_conv_activation="silu", feature_map="hedgehog", feature_size=3,
          positions="rope", qk_norm=True, norm_type="rmsnorm", form="parallel"), (1, 6)),
    # gated (Mamba-2 / GLA), delta rule (DeltaNet) and gated delta rule (Gated DeltaNet)
    (dict(short_conv=4, short_conv_activation="silu", gate="scalar", positions="rope", n_kv_heads=1,
          form="chunked", chunk_size=3, n_layers=1), (2, 6)),
    (dict(short_conv=2, gate="vector", feature_map="identity", normalize=False, positions="rope",
          rope_on="inputs", form="recurrent"), (1, 5)),
    (dict(short_conv=3, short_conv_activation="silu", update="delta", feature_map="identity",
          normalize=False, positions="rope", n_kv_heads=1, form="chunked", chunk_size=2), (1, 7)),
    (dict(short_conv=4, update="delta", gate="scalar", feature_map="elu+1", normalize=False,
          positions="learned", norm_type="rmsnorm", form="recurrent", n_layers=1), (2, 6)),
    # the hybrids: an exact window and sinks, with LoLA's sparse cache, and local layers around a
    # linear global one
    (dict(short_conv=3, short_conv_activation="silu", feature_map="hedgehog", window=3, sinks=1,
          positions="rope", rope_on="inputs", n_kv_heads=1), (1, 6)),
    (dict(short_conv=4, feature_map="elu+1", window=2, sinks=1, cache=2, positions="none", form="recurrent",
          n_layers=1), (2, 7)),
    (dict(short_conv=3, short_conv_activation="silu", layer_types=("local", "global"), sliding_window=2,
          positions="rope", rope_on="inputs", gate="scalar"), (1, 6)),
]


def perturb_taps(variables, seed: int, scale: float = 0.5):
    """Random convolution taps (``conv_q``, ``conv_k``, ``conv_v``) around their identity init."""
    key = jax.random.PRNGKey(seed)

    def perturb(path, x):
        if path[-1].key in SHORT_CONV_STATE:
            return x + scale * jax.random.normal(jax.random.fold_in(key, zlib.crc32(str(path).encode())),
                                                 x.shape, x.dtype)
        return x
    return {**variables, "params": jax.tree_util.tree_map_with_path(perturb, variables["params"])}


def random_variables(cfg, seed):
    model, variables = init(cfg, seed)
    return model, perturb_taps(perturb_learned_maps(variables, seed + 5), seed + 7)


def without_taps(params):
    """``params`` without the convolution's taps (the parameters of the same model without it)."""
    return {scope: {**block, "attn": {n: a for n, a in block["attn"].items() if n not in SHORT_CONV_STATE}}
            if isinstance(block, dict) and "attn" in block else block for scope, block in params.items()}


def without_conv_state(converted):
    """The converted variables with every stored convolution state zeroed (the other state kept)."""
    return {**converted, PROMPT_STATE: jax.tree_util.tree_map_with_path(
        lambda p, x: jnp.zeros_like(x) if p[-1].key in SHORT_CONV_STATE else x, converted[PROMPT_STATE])}


def identities(model, variables, prompt, second, query):
    """Every logit and state the identities compare, in one program per prompt length."""
    n = prompt.shape[1]
    full = jnp.concatenate([jnp.broadcast_to(prompt, (query.shape[0], n)), query], axis=1)
    converted = iclca.convert(model, variables, prompt)
    twice = iclca.convert(model, converted, second)
    once = iclca.convert(model, variables, jnp.concatenate([prompt, second], axis=1))
    only_second = iclca.convert(model, variables, second)
    return dict(converted=model.apply(converted, query), prompted=model.apply(variables, full)[:, n:],
                no_prompt=model.apply(variables, query),
                conv_zeroed=model.apply(without_conv_state(converted), query),
                state=converted[PROMPT_STATE], twice_state=twice[PROMPT_STATE], once_state=once[PROMPT_STATE],
                twice=model.apply(twice, query), once=model.apply(once, query),
                only_second=model.apply(only_second, query))


class Family:
    """A config, its model and its jitted identity program, built once."""

    def __init__(self, index: int):
        self.cfg = linicl.ModelConfig(**{**_BASE, **FAMILIES[index][0]})
        self.lengths = FAMILIES[index][1]
        self.model = linicl.Transformer(self.cfg)
        self.identities = jax.jit(lambda *a: identities(self.model, *a))


_FAMILIES: dict = {}


def family(index: int) -> Family:
    if index not in _FAMILIES:
        _FAMILIES[index] = Family(index)
    return _FAMILIES[index]


def check_identities(cfg, out) -> None:
    # converted = prompted; power: no prompt, or the prompt without its convolution state, is far off
    assert rel_err(out["converted"], out["prompted"]) <= EXACT_RTOL
    assert rel_err(out["no_prompt"], out["prompted"]) >= BASELINE_MIN
    assert rel_err(out["conv_zeroed"], out["prompted"]) >= BASELINE_MIN
    # converting twice = converting the concatenation (state and logits); power: p2 alone is far off
    assert_same_state(out["twice_state"], out["once_state"])
    assert rel_err(out["twice"], out["once"]) <= EXACT_RTOL
    assert rel_err(out["only_second"], out["once"]) >= BASELINE_MIN
    # every global linear layer stores the convolution's last K - 1 inputs of q, k, v
    K, H, G, d = cfg.short_conv, cfg.n_heads, cfg.kv_heads, cfg.head_dim
    for layer in cfg.global_layers:
        attn = out["state"][f"layers_{layer}"]["attn"]
        assert {n: attn[n].shape for n in SHORT_CONV_STATE} == {
            "conv_q": (1, K - 1, H, d), "conv_k": (1, K - 1, G, d), "conv_v": (1, K - 1, G, d)}
    assert prompt_floats({PROMPT_STATE: out["state"]}) == iclca.state_floats(cfg)


# ------------------------------------------------------------------------------------ identities
@pytest.mark.parametrize("index", range(len(FAMILIES)))
@settings(max_examples=N_EXAMPLES)
@given(seed=st.integers(0, 2**16), data=st.data())
def test_converted_equals_prompted_and_twice_equals_the_concatenation(index, seed, data):
    fam = family(index)
    # Each length compiles the program anew: the ci profile takes the short one (below K - 1 where
    # K > 2) in every other family and the long one in the rest; thorough both.
    lengths = fam.lengths if THOROUGH else fam.lengths[index % 2:][:1]
    n = data.draw(st.sampled_from(lengths), label="n")
    _, variables = random_variables(fam.cfg, seed)
    prompt, query = prompt_and_query(seed + 1, 1, n, BATCH, QUERY_LEN, fam.cfg.vocab_size)
    second = tokens(seed + 3, 1, SECOND, fam.cfg.vocab_size)
    check_identities(fam.cfg, fam.identities(variables, prompt, second, query))


@pytest.mark.parametrize("family_name", ["any", *OFFSET_FAMILIES])
@settings(max_examples=40 if THOROUGH else 1)
@given(data=st.data(), K=st.sampled_from([2, 3, 4]), activation=st.sampled_from(["none", "silu"]),
       recurrence=st.sampled_from(["add", "scalar", "vector", "delta", "gated-delta"]),
       n=st.integers(1, 7), seed=st.integers(0, 2**16))
def test_configs_from_the_shared_strategies(family_name, data, K, activation, recurrence, n, seed):
    """Configs of ``finite_state_configs`` (hedgehog, windows, sinks, local layers, rope on the features
    or inputs, ...) with a convolution added and, off the hybrids, a gate or the delta rule."""
    cfg = data.draw(finite_state_configs(family=None if family_name == "any" else family_name), label="cfg")
    cfg = cfg.replace(short_conv=K, short_conv_activation=activation)
    if not cfg.hybrid and recurrence != "add":
        gate = {"scalar": "scalar", "vector": "vector", "delta": "none", "gated-delta": "scalar"}[recurrence]
        if gate == "vector" and cfg.positions == "rope" and cfg.rope_on == "features":
            gate = "scalar"
        changes = dict(gate=gate, decay=None)
        if recurrence.endswith("delta"):
            changes.update(update="delta", normalize=False, trainable_bias=False)
        cfg = cfg.replace(**changes)
    model, variables = random_variables(cfg, seed)
    prompt, query = prompt_and_query(seed + 1, 1, n, BATCH, 4, cfg.vocab_size)
    second = tokens(seed + 3, 1, SECOND, cfg.vocab_size)
    check_identities(cfg, jax.jit(lambda *a: identities(model, *a))(variables, prompt, second, query))


# ------------------------------------------------------------------------------------ decode, forms
def _decode_program(cfg):
    """jit(variables, x) -> logits of ``x`` in every form and through the decode collection (the first
    token in one call, then a ``lax.scan`` of one-token calls), from the variables as given (a
    converted model's decode starts from its prompt state)."""
    forms = ("recurrent",) if cfg.cache else [f for f in FORMS if f != "auto"]  # a cache: recurrent only
    models = {form: linicl.Transformer(cfg.replace(form=form)) for form in forms}
    decoder = linicl.Transformer(cfg.replace(form="auto"))  # as linicl.generate runs it

    def run(variables, x):
        out = {form: model.apply(variables, x) for form, model in models.items()}
        logits, state = decoder.apply(variables, x[:, :1], mutable=[DECODE])

        def step(state, tok):
            step_logits, state = decoder.apply({**variables, **state}, tok[:, None], mutable=[DECODE])
            return state, step_logits[:, 0]
        state, rest = jax.lax.scan(step, state, x[:, 1:].T)
        out["decode"] = jnp.concatenate([logits, jnp.swapaxes(rest, 0, 1)], axis=1)
        return out, state[DECODE]
    return jax.jit(run)


@pytest.mark.parametrize("index", (1, 7, 9, 10, 11))
def test_a_decode_token_by_token_and_every_form_equal_the_forward(index):
    """From a fresh model and from a converted one (short prompt: its zeros shift through the decode);
    the decode carries the convolution's state beside the attention's."""
    fam = family(index)
    cfg = fam.cfg.replace(chunk_size=3)
    model, variables = random_variables(cfg, index)
    x = tokens(index, 2, 7, cfg.vocab_size)
    run = _decode_program(cfg)
    converted = iclca.convert(model, variables, tokens(index + 1, 1, 1, cfg.vocab_size))
    for start in (variables, converted):
        out, state = run(start, x)
        for name, logits in out.items():
            assert rel_err(logits, out["recurrent"]) <= EXACT_RTOL, name
        for layer in cfg.global_layers:
            assert set(SHORT_CONV_STATE) <= set(state[f"layers_{layer}"]["attn"])
    assert rel_err(run(converted, x)[0]["decode"], run(variables, x)[0]["decode"]) >= BASELINE_MIN


@pytest.mark.parametrize("index", (3, 8, 9))
@settings(max_examples=N_EXAMPLES)
@given(seed=st.integers(0, 2**16), sample=st.booleans())
def test_generation_after_conversion_equals_generation_after_the_prompt(index, seed, sample):
    fam = family(index)
    n = fam.lengths[0]  # shorter than K - 1
    _, variables = random_variables(fam.cfg, seed)
    prompt, query = prompt_and_query(seed + 1, 1, n, BATCH, QUERY_LEN, fam.cfg.vocab_size)
    full = jnp.concatenate([jnp.broadcast_to(prompt, (BATCH, n)), query], axis=1)
    converted = iclca.convert(fam.model, variables, prompt)
    key = jax.random.PRNGKey(seed) if sample else None
    np.testing.assert_array_equal(linicl.generate(fam.model, converted, query, 4, key=key),
                                  linicl.generate(fam.model, variables, full, 4, key=key))


# ------------------------------------------------------------------------------------ the layer itself
def test_identity_taps_are_the_model_without_a_convolution():
    """A new model's taps pass the input through: with no activation it is the model without the
    convolution (same parameters otherwise), and the config says which it is."""
    cfg = linicl.ModelConfig(**_BASE, positions="rope")
    with_conv = cfg.replace(short_conv=3)
    model, variables = init(with_conv, 0)
    plain = {**variables, "params": without_taps(variables["params"])}
    taps = variables["params"]["layers_0"]["attn"]["conv_k"]
    assert taps.shape == (3, cfg.kv_heads, cfg.head_dim)
    np.testing.assert_array_equal(taps, jnp.zeros_like(taps).at[-1].set(1))
    x = tokens(0, 2, 6, cfg.vocab_size)
    np.testing.assert_allclose(model.apply(variables, x), linicl.Transformer(cfg).apply(plain, x), rtol=1e-14)
    assert "conv=3" in with_conv.describe() and "conv" not in cfg.describe()
    assert "conv=3/silu" in with_conv.replace(short_conv_activation="silu").describe()
    assert linicl.ModelConfig().short_conv == 0  # old configs keep their meaning


def test_the_stored_state_is_the_last_projections():
    """The stored convolution state is the last K - 1 projections of the prompt (the convolution's
    inputs, before any activation), and a prompt shorter than K - 1 leaves zeros before them."""
    cfg = linicl.ModelConfig(**{**_BASE, "n_layers": 1}, short_conv=3, short_conv_activation="silu", norm="none")
    model, variables = random_variables(cfg, 3)
    prompt = tokens(5, 1, 4, cfg.vocab_size)
    state = iclca.convert(model, variables, prompt)[PROMPT_STATE]["layers_0"]["attn"]
    x = variables["params"]["embed"][prompt[0]]                    # norm="none": the block's input
    p = variables["params"]["layers_0"]["attn"]
    for name, n in zip(SHORT_CONV_STATE, ("q", "k", "v")):
        proj = np.einsum("tm,mhd->thd", x, p[n]["kernel"]) + p[n]["bias"]
        np.testing.assert_allclose(state[name][0], proj[-2:], rtol=1e-13, atol=1e-13)
    one = iclca.convert(model, variables, prompt[:, :1])[PROMPT_STATE]["layers_0"]["attn"]["conv_v"]
    np.testing.assert_array_equal(one[0, 0], 0.0)                  # a 1-token prompt: zeros shift in


# ------------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize("changes, says", [
    (dict(short_conv=1), "ModelConfig.short_conv must be 0 (no convolution) or an int >= 2"),
    (dict(short_conv=-2), "ModelConfig.short_conv must be 0"),
    (dict(short_conv=2.0), "ModelConfig.short_conv must be 0"),
    (dict(short_conv=True), "ModelConfig.short_conv must be 0"),
    (dict(short_conv="3"), "ModelConfig.short_conv must be 0"),
    (dict(short_conv=3, short_conv_activation="gelu"), "ModelConfig.short_conv_activation must be one of"),
    (dict(short_conv_activation="silu"), "ModelConfig.short_conv_activation='silu' acts after a short"),
    (dict(short_conv=3, attention="softmax"), "ModelConfig.short_conv=3 applies to attention='linear'"),
])
def test_bad_configs_are_refused_by_name(changes, says):
    with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace(")", r"\)")):
        linicl.ModelConfig(**changes)


def test_local_layers_have_no_convolution_and_numpy_ints_are_accepted():
    cfg = linicl.ModelConfig(short_conv=np.int64(3), layer_types=("local", "global"), sliding_window=2,
                             positions="rope", rope_on="inputs")
    assert cfg.short_conv == 3 and type(cfg.short_conv) is int
    assert cfg.layer_config(0).short_conv == 0 and cfg.layer_config(1).short_conv == 3


def test_foreign_or_incomplete_states_and_bias_methods_are_refused():
    fam = family(0)
    model, variables = random_variables(fam.cfg, 0)
    prompt, query = prompt_and_query(1, 1, 3, 2, 2, fam.cfg.vocab_size)
    converted = iclca.convert(model, variables, prompt)
    # a state without the convolution's entries: named, never silently zero
    layer = converted[PROMPT_STATE]["layers_0"]["attn"]
    missing = {**converted, PROMPT_STATE: {"layers_0": {"attn": {k: v for k, v in layer.items() if k != "conv_k"}}}}
    with pytest.raises(LiniclError, match="has no 'conv_k'"):
        model.apply(missing, query)
    # a conv state in a model without the convolution, and a state of the wrong K
    plain = linicl.Transformer(fam.cfg.replace(short_conv=0))
    params = without_taps(variables["params"])
    with pytest.raises(LiniclError, match="stored by a different model"):
        plain.apply({**converted, "params": params}, query)
    wider = linicl.Transformer(fam.cfg.replace(short_conv=3))
    _, wide_vars = random_variables(wider.cfg, 0)
    with pytest.raises(LiniclError, match=r"expects conv_q\[batch, 2, 3, 4\]"):
        wider.apply({**wide_vars, PROMPT_STATE: converted[PROMPT_STATE]}, query)
    with pytest.raises(LiniclError, match="short convolution"):
        iclca.to_trainable(model, converted)
    with pytest.raises(LiniclError, match="short convolution"):
        iclca.bias_terms(converted)


def test_the_implicit_context_term_refuses_the_convolution():
    """The closed-form context term reads the context through S alone; the convolution's state also
    carries it, so the form is refused rather than wrong (``diagnostics.normalisers`` likewise)."""
    cfg = linicl.ModelConfig(**_BASE, feature_map="identity", normalize=False, short_conv=2)
    with pytest.raises(NotExactError, match="short_conv=2"):
        implicit.context_term(cfg, None, None, jnp.zeros(cfg.d_model))
