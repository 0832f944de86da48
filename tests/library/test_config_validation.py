"""ModelConfig checks every field's type and range: a bad value raises a ConfigError naming the field,
the value and what was expected (never a bare TypeError, never a silently different model); NumPy
numbers and bools are accepted and stored as Python's."""

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
import pytest

import linicl
from linicl.config import PRESETS, ModelConfig
from linicl.errors import ConfigError

NAN, INF = float("nan"), float("inf")

# (field, bad value) for every field of ModelConfig (n_heads = 4 by default). About half of these used
# to be accepted (a different model: decay="1111" became (1, 1, 1, 1), normalize=1 passed, attn_eps=-1
# built a model) or to fail with a bare TypeError (decay=True); the rest were refused and stay so.
BAD = [
    *[(f, v) for f in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_len", "chunk_size")
      for v in (0, -3, 3.5, True, "64", None, np.float64(8.0))],
    ("mlp_depth", 1), ("mlp_depth", 2.0), ("mlp_depth", np.bool_(True)),
    *[(f, v) for f in ("feature_size", "window", "sinks", "cache", "sliding_window")
      for v in (-1, 1.5, True, "2", None)],
    ("layer_types", "local"), ("layer_types", ("local",)), ("layer_types", ("global", "loco")),
    ("layer_types", 3), ("layer_types", ("global", None)),
    *[("rope_local_base", v) for v in (0, -1.0, NAN, INF, "1e4", True)],
    *[("short_conv", v) for v in (1, -1, 2.5, True, "3", None, np.float64(3.0))],
    ("n_kv_heads", 0), ("n_kv_heads", 2.0), ("n_kv_heads", True), ("n_kv_heads", "2"), ("n_kv_heads", 3),
    *[("d_head", v) for v in (0, -2, 2.5, True, "8", np.float64(8.0))],
    *[("query_pre_attn_scalar", v) for v in (0, -1.0, NAN, INF, "16", True)],
    *[(f, v) for f in ("normalize", "causal", "use_bias", "tie_embeddings", "trainable_bias", "qk_norm",
                       "scale_embeddings")
      for v in (1, 0, "yes", "False", None, np.int64(1), 1.0)],
    *[(f, v) for f in ("final_norm", "attn_bias", "mlp_bias") for v in (1, 0, "no", np.int64(0))],
    *[(f, v) for f in ("rope_base", "ln_eps") for v in (0, 0.0, -1.0, NAN, INF, "1e4", True, None, [1.0])],
    *[("attn_eps", v) for v in (-1e-6, NAN, INF, -INF, "1e-6", True, None, np.bool_(False))],
    *[(f, v) for f in ("attention", "feature_map", "positions", "norm", "norm_type", "skip", "mlp",
                       "rope_style", "rope_on", "activation", "form", "dtype", "gate", "update", "cache_rule",
                       "short_conv_activation")
      for v in ("nope", None, 1, ["linear"], np.array([1, 2]))],
    ("decay", "1111"), ("decay", "0.9"), ("decay", True), ("decay", np.bool_(True)), ("decay", NAN),
    ("decay", INF), ("decay", 1.5), ("decay", 0), ("decay", -0.5), ("decay", [0.9] * 3),
    ("decay", ["0.9"] * 4), ("decay", [[0.9]] * 4), ("decay", [0.9, 0.9, 0.9, True]),
    ("decay", [0.9, 0.9, 0.9, NAN]), ("decay", {0.9}), ("decay", np.full((1, 4), 0.9)),
    ("decay", {"a": 0.9}),
]


def _shown(value) -> list:
    """Ways a message may show ``value``."""
    out = [repr(value), str(value)]
    if isinstance(value, (list, np.ndarray)):
        out.append(repr(tuple(np.asarray(value, dtype=object).reshape(-1).tolist())))
    return out


@pytest.mark.parametrize("field, value", BAD, ids=[f"{f}={v!r}" for f, v in BAD])
def test_a_bad_field_raises_a_config_error_naming_field_and_value(field, value):
    with pytest.raises(ConfigError) as info:
        ModelConfig(**{field: value})
    message = str(info.value)
    assert f"ModelConfig.{field}" in message
    assert any(s in message for s in _shown(value)), message


def test_every_field_has_a_bad_value_in_the_table():
    """A new field must come with a check (and a row above)."""
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    assert fields == {f for f, _ in BAD}


@pytest.mark.parametrize("field, value, expected", [
    ("vocab_size", 3.5, "a positive int"), ("window", -1, "an int >= 0"), ("normalize", 1, "True or False"),
    ("final_norm", 1, "True, False or None"), ("rope_base", -1.0, "a finite float > 0"),
    ("ln_eps", NAN, "a finite float > 0"), ("attn_eps", -1e-6, "a finite float >= 0"),
    ("form", "fast", "must be one of"), ("decay", "1111", "None, a float or a sequence"),
])
def test_the_message_says_what_was_expected(field, value, expected):
    with pytest.raises(ConfigError, match=expected):
        ModelConfig(**{field: value})


def test_numpy_numbers_and_bools_are_accepted_and_stored_as_python_values():
    cfg = ModelConfig(vocab_size=np.int64(64), d_model=np.int32(32), n_heads=np.int16(4),
                      n_kv_heads=np.int64(2), window=np.uint8(3), normalize=np.bool_(True),
                      final_norm=np.bool_(False), decay=np.float32(0.5), rope_base=np.float32(1e4),
                      ln_eps=np.float64(1e-5), attn_eps=0, positions=np.str_("rope"), dtype=np.str_("float64"))
    plain = ModelConfig(vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, window=3, normalize=True,
                        final_norm=False, decay=0.5, rope_base=1e4, ln_eps=1e-5, attn_eps=0.0,
                        positions="rope", dtype="float64")
    assert cfg == plain and hash(cfg) == hash(plain)
    for f in dataclasses.fields(cfg):
        assert type(getattr(cfg, f.name)) is type(getattr(plain, f.name)), f.name
    assert type(cfg.decay) is float and type(cfg.rope_base) is float and type(cfg.attn_eps) is float
    # One decay per head: a list, a tuple, a NumPy or a JAX array, of any number types: one tuple.
    per_head = (0.5, 0.75, 0.875, 1.0)
    for d in (list(per_head), per_head, np.asarray(per_head), jnp.asarray(per_head),
              [np.float64(0.5), 0.75, np.float32(0.875), 1]):
        got = ModelConfig(decay=d).decay
        assert got == per_head and type(got) is tuple and all(type(g) is float for g in got)
    assert ModelConfig(decay=np.asarray(0.5)).decay == 0.5  # a 0-d array is one decay for all heads


def test_presets_and_old_configs_are_unchanged():
    for name, cfg in PRESETS.items():
        again = ModelConfig(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)})
        assert again == cfg and hash(again) == hash(cfg), name
    cfg = ModelConfig(decay=1, rope_base=500_000, ln_eps=1e-6, attn_eps=1e-3)  # ints where floats go
    assert cfg.decay == 1.0 and cfg.rope_base == 500_000.0 and cfg.decay_per_head() == (1.0,) * 4
    assert linicl.preset("tiny-linear", normalize=False, feature_map="identity").normalize is False


@pytest.mark.parametrize("changes, width", [
    (dict(attention="linear"), "feature dimension"),                       # elu+1: d_phi = d_head = 1
    (dict(attention="linear", feature_map="hedgehog", rope_on="inputs"), "head dimension"),
    (dict(attention="linear", feature_map="taylor2", window=2), "head dimension"),  # the exact part
    (dict(attention="softmax"), "head dimension"),
])
def test_rope_that_would_rotate_nothing_is_refused(changes, width):
    """head_dim = 1: a rotation of pairs of coordinates has no pair to rotate, so the model would
    have no positional signal at all (before: refused for softmax only)."""
    with pytest.raises(ConfigError, match=f"ModelConfig.positions='rope' needs a {width}"):
        ModelConfig(d_model=4, n_heads=4, positions="rope", **changes)


def test_rope_on_wide_enough_features_of_a_one_dim_head_is_kept():
    # taylor2 of d_head = 1 has d_phi = 3 and hedgehog 2m: the rotated features carry the positions.
    for cfg in (ModelConfig(d_model=4, n_heads=4, positions="rope", feature_map="taylor2"),
                ModelConfig(d_model=4, n_heads=4, positions="rope", feature_map="hedgehog")):
        assert cfg.head_dim == 1 and cfg.feature_dim >= 2


def test_a_bad_float_never_reaches_the_model():
    """``attn_eps=-1`` used to build a model whose denominators could cross zero; NaN eps gave NaN logits."""
    for kw in (dict(attn_eps=-1.0), dict(ln_eps=NAN), dict(rope_base=-10.0)):
        with pytest.raises(ConfigError):
            ModelConfig(**kw)
    assert math.isfinite(ModelConfig(attn_eps=0).attn_eps)
