"""ICLCA on the gated and delta-rule mixers (``ModelConfig.gate``, ``update``): exact conversion,
repeated conversion, generation, forms and decode, the layer against a NumPy recurrence, the power
of the gate and of the write strength, and the refused combinations.

As in ``test_families.py`` the models are a fixed list of families, each with its jitted programs
built once, so hypothesis spends its examples on parameters, tokens and prompt lengths (each family
has two prompt lengths, so at most two compiles of each program; the ci profile uses one of them).
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import linicl
from linicl import iclca
from linicl.errors import ConfigError, LiniclError
from linicl.memory import prompt_floats
from linicl.names import DECODE, FORMS, PROMPT_STATE
from linicl.nn.attention import Attention
from helpers import EXACT_RTOL, init, perturb_learned_maps, prompt_and_query, rel_err, tokens

THOROUGH = os.environ.get("HYPOTHESIS_PROFILE") == "thorough"
N_EXAMPLES = 100 if THOROUGH else 2
FAR = 1e-3  # the no-prompt (or gate-free, ...) model is this far off at least: power
QUERY_LEN, BATCH, SECOND = 5, 2, 3  # query tokens, query batch, length of the second prompt

_BASE = dict(vocab_size=24, d_model=12, n_layers=2, n_heads=3, d_ff=8, max_len=64, attention="linear",
             dtype="float64")
# (config, prompt lengths). Gate kinds x updates x positions (rope on the features is re-based,
# rope on the inputs and learned positions keep the offset) x norms x forms x feature maps; some
# with one layer, which compiles in half the time.
FAMILIES = [
    (dict(gate="scalar", feature_map="elu+1", positions="none", n_kv_heads=1, n_layers=1), (1, 6)),
    (dict(gate="vector", feature_map="identity", normalize=False, positions="learned", norm="post",
          form="recurrent", trainable_bias=True), (1, 6)),
    (dict(gate="scalar", feature_map="relu", attn_eps=1e-3, positions="rope", rope_style="half",
          norm_type="rmsnorm", mlp="gated", activation="silu", form="chunked", chunk_size=3, n_layers=1),
     (2, 7)),
    (dict(gate="vector", feature_map="hedgehog", feature_size=3, positions="rope", rope_on="inputs",
          norm="none", skip="residual", form="chunked", chunk_size=2, n_layers=1), (1, 5)),
    (dict(update="delta", feature_map="identity", normalize=False, positions="rope", n_kv_heads=1,
          form="chunked", chunk_size=2), (1, 7)),
    (dict(update="delta", gate="scalar", feature_map="elu+1", normalize=False, positions="learned",
          norm="post", norm_type="rmsnorm", form="recurrent"), (3, 6)),
    (dict(update="delta", gate="scalar", feature_map="taylor2", d_model=9, normalize=False,
          positions="rope", rope_on="inputs", norm="none", skip="dherin", form="parallel", n_layers=1), (1, 4)),
]


class Family:
    """A config, its model and its jitted identity program, built once."""

    def __init__(self, index: int):
        self.cfg = linicl.ModelConfig(**{**_BASE, **FAMILIES[index][0]})
        self.lengths = FAMILIES[index][1]
        self.model, _ = init(self.cfg, 0)
        self.identities = jax.jit(self._identities)

    def variables(self, seed: int):
        _, variables = init(self.cfg, seed)
        return perturb_learned_maps(variables, seed)

    def _identities(self, variables, prompt, second, query):
        """Every logit and state the identities compare, in one program per prompt length."""
        model = self.model

        n = prompt.shape[1]
        full = jnp.concatenate([jnp.broadcast_to(prompt, (query.shape[0], n)), query], axis=1)
        converted = iclca.convert(model, variables, prompt)
        twice = iclca.convert(model, converted, second)
        once = iclca.convert(model, variables, jnp.concatenate([prompt, second], axis=1))
        # Twice and once are compared by their states: the logits are a function of them.
        return dict(converted=model.apply(converted, query), prompted=model.apply(variables, full)[:, n:],
                    no_prompt=model.apply(variables, query), state=converted[PROMPT_STATE],
                    twice_state=twice[PROMPT_STATE], once_state=once[PROMPT_STATE])


_FAMILIES: dict = {}


def family(index: int) -> Family:
    if index not in _FAMILIES:
        _FAMILIES[index] = Family(index)
    return _FAMILIES[index]


# ------------------------------------------------------------------------------------ identities
@pytest.mark.parametrize("index", range(len(FAMILIES)))
@settings(max_examples=N_EXAMPLES)
@given(seed=st.integers(0, 2**16), data=st.data())
def test_converted_equals_prompted_and_twice_equals_the_concatenation(index, seed, data):
    fam = family(index)
    # Each length compiles the program anew: the ci profile takes one per family (alternately the
    # short and the long one), thorough both.
    lengths = fam.lengths if THOROUGH else fam.lengths[index % 2:][:1]
    n = data.draw(st.sampled_from(lengths), label="n")
    variables = fam.variables(seed)
    prompt, query = prompt_and_query(seed + 1, 1, n, BATCH, QUERY_LEN, fam.cfg.vocab_size)
    second = tokens(seed + 3, 1, SECOND, fam.cfg.vocab_size)
    out = fam.identities(variables, prompt, second, query)
    # The converted model with no prompt is the prompted model; without the state it is far off.
    assert rel_err(out["converted"], out["prompted"]) <= EXACT_RTOL
    assert rel_err(out["no_prompt"], out["prompted"]) >= FAR
    # Converting twice is converting [prompt; second]: the same state (so the same logits). A second
    # conversion that dropped the first prompt would fail this: the first prompt matters (above).
    once = dict(jax.tree_util.tree_leaves_with_path(out["once_state"]))
    first = dict(jax.tree_util.tree_leaves_with_path(out["state"]))
    for path, a in jax.tree_util.tree_leaves_with_path(out["twice_state"]):
        assert rel_err(a, once[path]) <= EXACT_RTOL, jax.tree_util.keystr(path)
        assert rel_err(a, first[path]) >= FAR  # power: the second prompt is stored too
    # The state holds what state_floats counts: S and z, or S alone for the delta rule.
    fields = set(out["state"]["layers_0"]["attn"])
    assert fields == ({"S"} if fam.cfg.update == "delta" else {"S", "z"})
    assert prompt_floats({PROMPT_STATE: out["state"]}) == iclca.state_floats(fam.cfg)


GENERATION = (3, 4)  # vector gate with rope on the inputs (offset kept); the delta rule, re-based rope


@pytest.mark.parametrize("index", GENERATION)
@settings(max_examples=N_EXAMPLES)
@given(seed=st.integers(0, 2**16))
def test_generation_after_conversion_equals_generation_after_the_prompt(index, seed):
    fam = family(index)
    n = fam.lengths[-1]
    variables = fam.variables(seed)
    prompt, query = prompt_and_query(seed + 1, 1, n, BATCH, QUERY_LEN, fam.cfg.vocab_size)
    full = jnp.concatenate([jnp.broadcast_to(prompt, (BATCH, n)), query], axis=1)
    converted = iclca.convert(fam.model, variables, prompt)
    np.testing.assert_array_equal(linicl.generate(fam.model, converted, query, 4),
                                  linicl.generate(fam.model, variables, full, 4))


# ------------------------------------------------------------------------------------ forms, decode
def _forms_program(cfg):
    """jit(variables, x) -> logits of x in every form, and read through the decode collection (the
    first half in one call, then a ``lax.scan`` of one-token calls)."""
    models = {form: linicl.Transformer(cfg.replace(form=form)) for form in FORMS if form != "auto"}
    decoder = linicl.Transformer(cfg.replace(form="auto"))  # as linicl.generate runs it

    def run(variables, x):
        out = {form: model.apply(variables, x) for form, model in models.items()}
        first = x.shape[1] // 2
        logits, state = decoder.apply(variables, x[:, :first], mutable=[DECODE])

        def step(state, tok):
            step_logits, state = decoder.apply({**variables, **state}, tok[:, None], mutable=[DECODE])
            return state, step_logits[:, 0]
        _, rest = jax.lax.scan(step, state, x[:, first:].T)
        out["decode"] = jnp.concatenate([logits, jnp.swapaxes(rest, 0, 1)], axis=1)
        return out
    return jax.jit(run)


@pytest.mark.parametrize("index", (1, 5))
def test_every_form_and_the_decode_agree(index):
    """Parallel, chunked (3 chunks of 3, the last one short) and recurrent forms, and a decode one
    token at a time, give the same logits (a vector-gated and a gated delta-rule family)."""
    cfg = family(index).cfg.replace(chunk_size=3)
    _, variables = init(cfg, index)
    x = tokens(index, 2, 8, cfg.vocab_size)
    out = _forms_program(cfg)(variables, x)
    for name, logits in out.items():
        assert rel_err(logits, out["recurrent"]) <= EXACT_RTOL, name


# ------------------------------------------------------------------------------------ the layer itself
def _sigmoid(a):
    return 1 / (1 + np.exp(-a))


def _reference_layer(cfg, p, x):
    """The attention layer in NumPy, token by token, from its documented recurrence (no positions,
    elu+1 or identity features): ``x: f[T, d_model]`` -> ``f[T, d_model]``."""
    H, G, d = cfg.n_heads, cfg.n_heads // cfg.kv_heads, cfg.head_dim
    proj = {n: x @ np.asarray(p[n]["kernel"]).reshape(cfg.d_model, -1) + np.asarray(p[n]["bias"]).reshape(-1)
            for n in ("q", "k", "v")}
    q, k, v = (proj[n].reshape(len(x), -1, d) for n in ("q", "k", "v"))
    k, v = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)      # grouped-query heads
    phi = (lambda a: np.where(a > 0, a + 1, np.exp(a))) if cfg.feature_map == "elu+1" else (lambda a: a)
    fq, fk = phi(q), phi(k)
    if cfg.update == "delta":
        fq = fq / np.sqrt((fq ** 2).sum(-1, keepdims=True) + cfg.attn_eps)
        fk = fk / np.sqrt((fk ** 2).sum(-1, keepdims=True) + cfg.attn_eps)
        beta = _sigmoid(x @ np.asarray(p["beta_proj"]["kernel"]) + np.asarray(p["beta_proj"]["bias"]))
    gate = _sigmoid(np.einsum("tm,m...->t...", x, np.asarray(p["gate_proj"]["kernel"]))
                    + np.asarray(p["gate_proj"]["bias"]))        # alpha: [T, H] or [T, H, d_phi]
    S, z = np.zeros((H, fk.shape[-1], d)), np.zeros((H, fk.shape[-1]))
    out = np.zeros((len(x), H, d))
    for t in range(len(x)):
        for h in range(H):
            a = gate[t, h][:, None] if cfg.gate == "vector" else gate[t, h]
            if cfg.update == "delta":
                erased = S[h] - beta[t, h] * np.outer(fk[t, h], fk[t, h] @ S[h])     # (I - b k k^T) S
                S[h] = a * erased + beta[t, h] * np.outer(fk[t, h], v[t, h])
                out[t, h] = fq[t, h] @ S[h]
            else:
                S[h] = a * S[h] + np.outer(fk[t, h], v[t, h])
                z[h] = np.reshape(a, -1) * z[h] + fk[t, h]
                out[t, h] = fq[t, h] @ S[h] / (fq[t, h] @ z[h] + cfg.attn_eps)
    return out.reshape(len(x), -1) @ np.asarray(p["o"]["kernel"]).reshape(-1, cfg.d_model) + np.asarray(p["o"]["bias"])


@pytest.mark.parametrize("changes", [
    dict(gate="vector", n_kv_heads=1),
    dict(gate="scalar", update="delta", feature_map="identity", normalize=False, n_kv_heads=1),
])
def test_the_layer_is_the_documented_recurrence(changes):
    """One attention layer against a NumPy loop over tokens: log_sigmoid gates of the layer's input,
    per query head; the delta rule's unit features and beta = sigmoid(x W + b)."""
    cfg = linicl.ModelConfig(**{**_BASE, **changes})
    layer = Attention(cfg)
    x = jax.random.normal(jax.random.PRNGKey(1), (1, 7, cfg.d_model), jnp.float64)
    positions = jnp.arange(7, dtype=jnp.int32)
    params = jax.jit(layer.init)(jax.random.PRNGKey(0), x, positions)["params"]
    # Biases around a moderate gate and write strength, so that both vary with the token.
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape) * 0.5, a.dtype), params)
    got = jax.jit(layer.apply)({"params": params}, x, positions)[0]
    assert rel_err(got, _reference_layer(cfg, params, np.asarray(x[0]))) <= EXACT_RTOL


@pytest.mark.parametrize("gate", ("scalar", "vector"))
def test_the_gate_is_used_and_a_constant_gate_is_a_fixed_decay(gate):
    """Power: a strong data-dependent gate moves the logits far from the same model without it, and
    from the same gate made constant; a constant gate sigmoid(b_h) is exactly the fixed per-head
    decay gamma_h = sigmoid(b_h) (so log_sigmoid, not sigmoid, is the log-gate)."""
    cfg = linicl.ModelConfig(**{**_BASE, "gate": gate, "positions": "learned", "n_layers": 1})
    b = np.array([-1.0, 0.5, 2.0])  # alpha from 0.27 to 0.88: strong gates
    gammas = tuple(float(g) for g in _sigmoid(b))
    decayed = linicl.Transformer(cfg.replace(gate="none", decay=gammas))
    model, variables = init(cfg, 3)
    x = tokens(4, 2, 9, cfg.vocab_size)

    def without_gate(tree):
        return {k: (without_gate(v) if isinstance(v, dict) else v) for k, v in tree.items() if k != "gate_proj"}

    def constant_gate(tree):
        if "gate_proj" not in tree:
            return {k: (constant_gate(v) if isinstance(v, dict) else v) for k, v in tree.items()}
        shape = tree["gate_proj"]["bias"].shape
        bias = jnp.broadcast_to(jnp.asarray(b).reshape((-1,) + (1,) * (len(shape) - 1)), shape)
        return {**tree, "gate_proj": {"kernel": jnp.zeros_like(tree["gate_proj"]["kernel"]), "bias": bias}}

    def strong(tree):  # the same data-dependent gate, with the strong biases
        if "gate_proj" not in tree:
            return {k: (strong(v) if isinstance(v, dict) else v) for k, v in tree.items()}
        return {**tree, "gate_proj": {**tree["gate_proj"], "bias": constant_gate(tree)["gate_proj"]["bias"]}}

    @jax.jit
    def run(params):
        return (model.apply({"params": strong(params)}, x),
                linicl.Transformer(cfg.replace(gate="none")).apply({"params": without_gate(params)}, x),
                model.apply({"params": constant_gate(params)}, x),
                decayed.apply({"params": without_gate(params)}, x))
    data_dependent, no_gate, constant, fixed_decay = run(variables["params"])
    assert rel_err(constant, fixed_decay) <= EXACT_RTOL
    assert rel_err(data_dependent, no_gate) >= FAR
    assert rel_err(data_dependent, constant) >= FAR


def test_the_delta_rule_uses_beta_and_differs_from_the_additive_state():
    cfg = linicl.ModelConfig(**{**_BASE, "update": "delta", "normalize": False, "feature_map": "identity",
                                "n_layers": 1})
    model, variables = init(cfg, 5)
    additive = linicl.Transformer(cfg.replace(update="add"))
    x = tokens(6, 2, 9, cfg.vocab_size)

    def drop_beta(tree):
        return {k: (drop_beta(v) if isinstance(v, dict) else v) for k, v in tree.items() if k != "beta_proj"}

    def beta_bias(tree, value):
        if "beta_proj" not in tree:
            return {k: (beta_bias(v, value) if isinstance(v, dict) else v) for k, v in tree.items()}
        return {**tree, "beta_proj": {**tree["beta_proj"], "bias": tree["beta_proj"]["bias"] + value}}

    @jax.jit
    def run(params):
        return (model.apply({"params": params}, x), model.apply({"params": beta_bias(params, 3.0)}, x),
                additive.apply({"params": drop_beta(params)}, x))
    delta, stronger_writes, add = run(variables["params"])
    assert rel_err(stronger_writes, delta) >= FAR
    assert rel_err(add, delta) >= FAR


# ------------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize("changes, field, says", [
    (dict(attention="softmax", gate="scalar"), "ModelConfig.gate='scalar'", "attention='linear' only"),
    (dict(attention="softmax", update="delta", normalize=False), "ModelConfig.update='delta'",
     "attention='linear' only"),
    (dict(update="delta"), "ModelConfig.update='delta'", "use normalize=False"),
    (dict(update="delta", normalize=False, decay=0.9), "ModelConfig.decay", "use gate='scalar'"),
    (dict(update="delta", normalize=False, gate="vector"), "ModelConfig.gate='vector'", "use gate='scalar'"),
    (dict(update="delta", normalize=False, trainable_bias=True), "ModelConfig.trainable_bias", "no z"),
    (dict(gate="vector", positions="rope"), "ModelConfig.gate='vector'", "rope_on='inputs'"),
    (dict(gate="scalar", decay=0.9), "ModelConfig.decay", "two decay mechanisms"),
    (dict(gate="vector", decay=(0.9, 0.8, 0.7)), "ModelConfig.gate='vector'", "two decay mechanisms"),
    (dict(gate="scalar", window=4), "ModelConfig.window=4", "use window=0"),
    (dict(update="delta", normalize=False, sinks=2), "ModelConfig.sinks=2", "use sinks=0"),
    (dict(gate="none", update="fast"), "ModelConfig.update", "must be one of"),
    (dict(gate="diagonal"), "ModelConfig.gate", "must be one of"),
])
def test_combinations_that_make_no_sense_are_refused(changes, field, says):
    with pytest.raises(ConfigError) as info:
        linicl.ModelConfig(**{**_BASE, **changes})
    assert field in str(info.value) and says in str(info.value), str(info.value)


def test_old_configs_are_unchanged_and_the_new_options_are_described():
    old = linicl.ModelConfig(**_BASE)
    assert old == old.replace(gate="none", update="add") and hash(old) == hash(old.replace(gate="none"))
    assert "gate" not in old.describe() and "update" not in old.describe()
    new = old.replace(gate="scalar", update="delta", normalize=False)
    assert "gate=scalar" in new.describe() and "update=delta" in new.describe()
    # Allowed: every position option with a scalar gate, rope on the inputs with a vector gate, the
    # delta rule with re-based rope, grouped-query heads, a gated trainable bias.
    for changes in (dict(gate="scalar", positions="rope"), dict(gate="vector", positions="rope", rope_on="inputs"),
                    dict(update="delta", normalize=False, positions="rope", n_kv_heads=1),
                    dict(gate="vector", positions="learned", trainable_bias=True)):
        linicl.ModelConfig(**{**_BASE, **changes})


def test_a_delta_state_is_not_an_additive_bias_and_states_do_not_cross_models():
    cfg = linicl.ModelConfig(**{**_BASE, "update": "delta", "normalize": False, "n_layers": 1})
    model, variables = init(cfg, 0)
    prompt = tokens(1, 1, 4, cfg.vocab_size)
    converted = iclca.convert(model, variables, prompt)
    with pytest.raises(LiniclError, match="has no z"):
        iclca.bias_terms(converted)
    with pytest.raises(LiniclError, match="delta-rule state"):
        iclca.to_trainable(model, converted)
    # An additive model's (S, z) read by a delta-rule model: refused, z is not silently dropped.
    add_model, add_variables = init(cfg.replace(update="add", normalize=True), 0)
    add_state = iclca.convert(add_model, add_variables, prompt)[PROMPT_STATE]
    with pytest.raises(LiniclError, match=r"holds \['z'\]"):
        model.apply({**variables, PROMPT_STATE: add_state}, prompt)
