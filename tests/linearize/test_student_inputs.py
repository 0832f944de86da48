"""What the student and baseline configs refuse (issue 52, item 8): ``window_config`` checks its
``cache_rule`` even when ``cache=0`` leaves it nothing to choose, as ``ModelConfig`` would."""

import re

import pytest

import linicl
from linicl import linearize as LZ
from linicl.errors import ConfigError
from linicl.names import CACHE_RULES

TEACHER = linicl.ModelConfig(vocab_size=16, d_model=8, n_heads=2, d_ff=8, n_layers=1, max_len=32,
                             attention="softmax")


@pytest.mark.parametrize("cache", [0, 2])
@pytest.mark.parametrize("rule", ["bogus", "Attention", None, 1])
def test_window_config_refuses_an_unknown_cache_rule_with_or_without_a_cache(cache, rule):
    with pytest.raises(ConfigError, match=re.escape(f"window_config: cache_rule must be one of {CACHE_RULES}, got")):
        LZ.window_config(TEACHER, window=4, sinks=1, cache=cache, cache_rule=rule)


@pytest.mark.parametrize("rule", CACHE_RULES)
def test_window_config_keeps_a_known_rule_only_where_there_is_a_cache(rule):
    assert LZ.window_config(TEACHER, window=4, sinks=1, cache_rule=rule).cache_rule == "recall"
    assert LZ.window_config(TEACHER, window=4, sinks=1, cache=2, cache_rule=rule).cache_rule == rule
