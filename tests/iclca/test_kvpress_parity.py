"""Query-agnostic selection (``linicl.selection``) against NVIDIA's ``kvpress`` on SmolLM2-135M-Instruct.

The reference ``fixtures/hf/kvpress-reference.npz`` (+ ``.json``) was written by
``fixtures/hf/make_kvpress_reference.py`` in a separate torch environment (torch 2.13.0+cpu,
transformers 5.2.0, kvpress 0.5.5): transformers dequantises the same Q4_1 GGUF linicl loads and runs
it in float32; each press's ``score`` output (layers x KV heads x tokens) and the positions it keeps at
compression ratios 0.5 and 0.9 were recorded on two prompts of 256 ids (``plain``: BOS and text;
``chat``: SmolLM2's chat-template prefix and text). linicl reads the same ids in float64.

What is compared, and where the definitions differ (kvpress 0.5.5 files under ``kvpress/presses/``):

* Scores equal wherever the definitions coincide: the largest deviation of a head is at most
  ``SCORE_TOL`` = 1e-4 of that head's largest score. Measured (largest over heads and both prompts):
  Expected Attention 1.0e-5, SnapKV 2.9e-6 (window) and 2.5e-6 (suffix), observed attention 2.3e-6,
  KVzip 6.4e-6 (one chunk) and 7.8e-6 (first of two), key norms 2.3e-6; the two sides differ
  by transformers' float32 rounding through 30 layers. A shuffled score misses by O(1)
  (``test_the_comparisons_have_power``).
* Kept positions equal up to near-ties: every position kept by one side only has a reference score
  within ``2 * SCORE_TOL`` (of the same scale) of the reference's cutoff, the lowest score it kept.
  (Measured: no disagreement at all, at ratios 0.5 and 0.9, wherever the scores are defined alike.)
  linicl's sets come from ``selection.allocate`` with the press's allocation: ``ScorerPress.compress``
  (``scorer_press.py`` l. 93-96) keeps ``int(n * (1 - ratio))`` tokens in every head of every layer
  (``allocation="uniform"``); ``KVzipPress.compress_post`` (``kvzip_press.py`` l. 374-405) drops the
  ``int(numel * ratio)`` lowest scores over all layers and heads (``"global"``). Presses protect tokens
  by padding them with ``max + 1`` (sinks; SnapKV's window); ``allocate``'s ``sinks`` and ``window``
  do the same. (``convert_approx``'s default allocation for the attention scores is ``"global"``, KVzip's
  choice, also for the scores whose presses kvpress runs per head.)

Per score:

* ``"expected"`` = ``ExpectedAttentionPress`` (``expected_attention_press.py``): the same statistics (the
  queries after the 4 sinks, biased covariance), mean rope rotation of positions n .. n + 511, group
  mean, times ``||v||`` (epsilon 0). Compared on every token after the sinks (kvpress gives the sinks
  ``max + 1``, linicl 0 and keeps them through ``allocate``).
* ``"snapkv"`` without ``instruction`` = ``SnapKVPress(window_size=64, kernel_size=5)``
  (``snapkv_press.py``): mean over the last 64 prompt queries of their attention, smoothed over 5
  tokens, mean over the group. One difference: kvpress cuts the window's own columns off *before*
  pooling (l. 67 ``attn_weights[..., :-window_size]``, then l. 96 ``avg_pool1d`` with zero padding),
  linicl pools over all n columns (``selection._h2o`` then ``kv_scores.pool``), so the two columns just
  before the window (n - 66, n - 65) also average in the window's attention in linicl: larger there,
  equal elsewhere. kvpress also always keeps the 64 window tokens; ``convert_approx`` keeps its own
  ``window`` (16 by default) and scores the rest of the observation window like any token. With
  ``window=64`` in ``allocate`` the kept sets agree except at those two columns.
* ``"snapkv"`` with ``instruction`` (a fixed question-free suffix read after the prompt) =
  ``SnapKVPress`` on prompt + suffix with ``window_size`` = the suffix's length: the prompt columns are
  pooled with zero padding on both sides, so this form is exact on all n columns.
* ``"h2o"`` is the *sum* of the attention every prompt query gives a key (H2O's accumulated attention);
  ``ObservedAttentionPress`` (``observed_attention_press.py`` l. 44-48) divides it by the number of
  queries that see the key (``n - i``): a mean, which does not favour early tokens. Compared as
  ``h2o / (n - i)``; the kept sets of the raw sums differ (measured: 0.33 of the
  0.9-ratio set in common, 0.70 at 0.5).
* ``"recent"`` with 4 sinks = ``StreamingLLMPress``: the kept sets are identical.
* ``"reconstruction"`` = ``KVzipPress`` (``kvzip_press.py``) when the prompt fits one chunk (2048 ids)
  and the model has no chat template: ``instruction`` = kvpress's ``"\\n\\nRepeat the previous context
  exactly."`` ids followed by its suffix (``"\\n"``; ``prepare`` l. 252-262); the softmax of each
  re-reading query over the chunk's keys and the re-read (l. 306-313); max over the group's heads and
  the queries (l. 360).  Differences:

  - later chunks: kvpress reads ``"\\n\\nRepeat the part of the previous context exactly, starting
    with"``, the previous chunk's last 8 ids, *then* the suffix and the chunk (l. 256-262); linicl reads
    the same ``instruction`` before every chunk, then the 8 ids, then the chunk (no suffix between).
    With 128-id chunks the first chunk's scores are equal, the second's only correlated.
  - a chat template: kvpress finds the template's prefix (system and user openers) and treats the
    first ``prefix_length`` ids as outside the context (l. 103-120, 193, 236): they are neither re-read
    nor normalised over (only the 4 sinks are), and score 0, so they are dropped first (except the
    sinks). linicl re-reads the whole prompt it is given. The context's scores are only correlated.
  - KVzip+ (``kvzip_plus_normalization``, off by default) and ``layerwise`` are not in linicl.
* ``KnormPress`` is not a linicl score; it checks the keys themselves: ``||k||`` of linicl's keys
  (``hook_k``; rope keeps norms) against kvpress's.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import linicl
from linicl import selection
from linicl.interventions import run_with_cache
from linicl.kernels import kv_scores

from helpers import FIXTURES, smollm2_only

REF = FIXTURES / "kvpress-reference.npz"
PROMPTS = ("plain", "chat")
RATIOS = {"50": 0.5, "90": 0.9}
SCORE_TOL = 1e-4
SINKS = 4
SNAPKV_WINDOW = 64
SNAPKV_POOL_HALF = 2  # kvpress's kernel_size 5: a column averages 2 neighbours on each side

# One worker loads the float64 model for the whole module (``make test`` runs --dist loadgroup).
pytestmark = [smollm2_only, pytest.mark.skipif(not REF.exists(), reason=f"{REF.name} is missing"),
              pytest.mark.xdist_group("kvpress"), pytest.mark.slow]


@pytest.fixture(scope="module")
def ref():
    data = np.load(REF)
    return {k: data[k] for k in data.files}, json.loads(REF.with_suffix(".json").read_text())


@pytest.fixture(scope="module")
def smollm2():
    return linicl.lm.smollm2(dtype="float64", max_len=512)


@pytest.fixture(scope="module")
def ours(smollm2, ref):
    """``ours(prompt, score, **kw)``: linicl's scores ``f64[30, 3, 256]``, each computed once."""
    model, variables, _ = smollm2
    memo = {}

    def get(prompt, score, **kw):
        key = (prompt, score, json.dumps(kw, sort_keys=True))
        if key not in memo:
            memo[key] = selection.score_prompt(model, variables, ref[0][f"{prompt}_ids"], score, **kw)
        return memo[key]
    return get


# ------------------------------------------------------------------------------ measures
def head_errors(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """``f[layers, heads]``: the largest |got - want| of each head over that head's largest |want|."""
    return np.abs(got - want).max(-1) / np.abs(want).max(-1)


def n_kept(n: int, ratio: float) -> int:
    """Tokens a ``ScorerPress`` keeps per head (``kvpress.utils.compute_n_kept``)."""
    return max(1, int(n * (1 - ratio)))


def unexplained(kept: np.ndarray, want: np.ndarray, scores: np.ndarray, *, per_head: bool,
                tol: float = 2 * SCORE_TOL, forced: np.ndarray | None = None) -> int:
    """How many positions one side keeps and the other does not whose reference score is farther than
    ``tol`` (relative to the largest free score: of the head, or of all heads when not ``per_head``)
    from the reference's cutoff (its lowest kept free score): the disagreements near-ties do not
    explain. ``forced``: ``bool[n]`` columns both sides keep regardless of score."""
    free = np.ones(scores.shape[-1], bool) if forced is None else ~forced
    s = np.where(free, scores, np.nan)
    axis = -1 if per_head else None
    cutoff = np.nanmin(np.where(want & free, s, np.nan), axis=axis, keepdims=per_head)
    scale = np.nanmax(np.abs(s), axis=axis, keepdims=per_head)
    differ = kept != want
    return int((differ & ~(np.abs(s - cutoff) <= tol * scale)).sum())


def overlap(kept: np.ndarray, want: np.ndarray) -> float:
    return float((kept & want).sum() / want.sum())


def uniform(scores: np.ndarray, per_head: int, *, sinks: int = 0, window: int = 0) -> np.ndarray:
    L, G, _ = scores.shape
    return selection.allocate(scores, per_head * L * G, sinks=sinks, window=window, allocation="uniform")


def forced_mask(n: int, sinks: int = 0, window: int = 0) -> np.ndarray:
    m = np.zeros(n, bool)
    m[:sinks] = True
    if window:
        m[n - window:] = True
    return m


# ------------------------------------------------------------------------------ the keys
@pytest.mark.parametrize("prompt", PROMPTS)
def test_key_norms_equal_knorm_press(smollm2, ref, prompt):
    """The keys both sides score: ``-||k||`` (KnormPress) of linicl's keys, and its kept sets."""
    model, variables, _ = smollm2
    data, _ = ref
    ids = data[f"{prompt}_ids"]
    L = model.cfg.n_layers
    _, cache = run_with_cache(model, variables, ids[None], names=[f"blocks.{l}.attn.hook_k" for l in range(L)])
    got = -np.stack([np.linalg.norm(np.asarray(cache["k", l])[0], axis=-1).T for l in range(L)])  # [L, G, n]
    want = data[f"{prompt}_knorm_scores"].astype(np.float64)
    assert head_errors(got, want).max() <= SCORE_TOL
    for tag, ratio in RATIOS.items():
        kept, theirs = uniform(got, n_kept(len(ids), ratio)), data[f"{prompt}_knorm_kept{tag}"]
        assert unexplained(kept, theirs, want, per_head=True) == 0


# ------------------------------------------------------------------------------ the scores
@pytest.mark.parametrize("prompt", PROMPTS)
def test_expected_attention_equals_the_press(ours, ref, prompt):
    data, _ = ref
    got, want = ours(prompt, "expected"), data[f"{prompt}_expected_scores"].astype(np.float64)
    n = got.shape[-1]
    assert head_errors(got[..., SINKS:], want[..., SINKS:]).max() <= SCORE_TOL
    for tag, ratio in RATIOS.items():
        kept = uniform(got, n_kept(n, ratio), sinks=SINKS)
        theirs = data[f"{prompt}_expected_kept{tag}"]
        assert unexplained(kept, theirs, want, per_head=True, forced=forced_mask(n, SINKS)) == 0


@pytest.mark.parametrize("prompt", PROMPTS)
def test_snapkv_window_equals_the_press_but_at_the_window_edge(smollm2, ours, ref, prompt, monkeypatch):
    """The question-free window (the prompt's last 64 queries). linicl's unpooled window attention,
    cut at the window and pooled, is kvpress's score; linicl pools before cutting, which changes the
    two columns just ahead of the window and nothing else."""
    model, variables, _ = smollm2
    data, _ = ref
    got, want = ours(prompt, "snapkv"), data[f"{prompt}_snapkv_scores"].astype(np.float64)
    n = got.shape[-1]
    body, edge = n - SNAPKV_WINDOW, n - SNAPKV_WINDOW - SNAPKV_POOL_HALF
    with monkeypatch.context() as m:
        m.setattr(kv_scores, "pool", lambda scores, width: scores)
        raw = selection.score_prompt(model, variables, data[f"{prompt}_ids"], "snapkv")
    assert np.allclose(np.asarray(kv_scores.pool(raw, 5)), got, rtol=1e-12, atol=0)
    cut = np.asarray(kv_scores.pool(np.where(np.arange(n) < body, raw, 0.0), 5))  # kvpress's order
    assert head_errors(cut[..., :body], want[..., :body]).max() <= SCORE_TOL
    assert np.allclose(got[..., :edge], cut[..., :edge], rtol=1e-12, atol=0)
    assert (got[..., edge:body] > cut[..., edge:body]).all()  # the window's attention pooled in
    assert head_errors(got[..., :edge], want[..., :edge]).max() <= SCORE_TOL
    # Kept sets at ratio 0.5 (at 0.9 kvpress keeps 25 of its 64 window tokens, picked by top-k among
    # equal max + 1 scores: no score decides, and allocate refuses a budget below its window).
    assert not data[f"{prompt}_snapkv_kept90"][..., :body].any()
    theirs, per_head, forced = data[f"{prompt}_snapkv_kept50"], n_kept(n, 0.5), forced_mask(n, window=SNAPKV_WINDOW)
    assert unexplained(uniform(cut, per_head, window=SNAPKV_WINDOW), theirs, want, per_head=True, forced=forced) == 0
    kept = uniform(got, per_head, window=SNAPKV_WINDOW)
    assert overlap(kept, theirs) >= 0.99  # measured 0.996 (plain), 0.999 (chat)
    at_edge = (kept != theirs)[..., edge:body].any(-1)  # heads where an edge column changed the set
    assert unexplained(kept[~at_edge], theirs[~at_edge], want[~at_edge], per_head=True, forced=forced) == 0


@pytest.mark.parametrize("prompt", PROMPTS)
def test_snapkv_fixed_suffix_equals_the_press(ours, ref, prompt):
    data, _ = ref
    suffix = data["suffix_ids"]
    got = ours(prompt, "snapkv", instruction=suffix.tolist())
    n = got.shape[-1]
    want = data[f"{prompt}_snapkv_suffix_scores"].astype(np.float64)[..., :n]
    assert head_errors(got, want).max() <= SCORE_TOL
    for tag, ratio in RATIOS.items():
        per_head = n_kept(n + len(suffix), ratio) - len(suffix)  # kvpress keeps the suffix itself too
        kept = uniform(got, per_head)
        theirs = data[f"{prompt}_snapkv_suffix_kept{tag}"]
        assert theirs[..., n:].all()
        assert unexplained(kept, theirs[..., :n], want, per_head=True) == 0


@pytest.mark.parametrize("prompt", PROMPTS)
def test_h2o_over_its_query_count_equals_observed_attention(ours, ref, prompt):
    data, _ = ref
    h2o = ours(prompt, "h2o")
    n = h2o.shape[-1]
    got, want = h2o / (n - np.arange(n)), data[f"{prompt}_observed_scores"].astype(np.float64)
    assert head_errors(got, want).max() <= SCORE_TOL
    for tag, ratio in RATIOS.items():
        theirs = data[f"{prompt}_observed_kept{tag}"]
        assert unexplained(uniform(got, n_kept(n, ratio)), theirs, want, per_head=True) == 0
    # linicl's own H2O (the sum) keeps other tokens: the early ones, which more queries see.
    raw = uniform(h2o, n_kept(n, 0.9))
    assert overlap(raw, data[f"{prompt}_observed_kept90"]) < 0.5  # measured 0.33 (plain), 0.34 (chat)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_recent_equals_streaming_llm(ours, ref, prompt):
    data, _ = ref
    got = ours(prompt, "recent")
    n = got.shape[-1]
    for tag, ratio in RATIOS.items():
        kept = uniform(got, n_kept(n, ratio), sinks=SINKS)
        np.testing.assert_array_equal(kept, data[f"{prompt}_streaming_kept{tag}"])


def kvzip_instruction(meta, prompt: str) -> list:
    ins = meta["kvzip_instructions"][prompt]
    return ins["first"] + ins["suffix"]


def global_kept(scores: np.ndarray, ratio: float) -> np.ndarray:
    """KVzip's choice: drop the ``int(numel * ratio)`` lowest over all layers and heads, sinks kept."""
    tokens = scores.size - int(scores.size * ratio)
    return selection.allocate(scores, tokens, sinks=SINKS, window=0, allocation="global")


def test_reconstruction_equals_kvzip_in_one_chunk(ours, ref):
    data, meta = ref
    got = ours("plain", "reconstruction", instruction=kvzip_instruction(meta, "plain"))
    want = data["plain_kvzip_scores"].astype(np.float64)
    assert head_errors(got, want).max() <= SCORE_TOL
    n = got.shape[-1]
    for tag, ratio in RATIOS.items():
        assert unexplained(global_kept(got, ratio), data[f"plain_kvzip_kept{tag}"], want, per_head=False,
                           forced=forced_mask(n, SINKS)) == 0


def test_reconstruction_in_chunks_equals_kvzip_on_the_first_chunk_only(smollm2, ref, monkeypatch):
    """128-id chunks: the first chunk is re-read alike; the second after other ids (see above)."""
    model, variables, _ = smollm2
    data, meta = ref
    monkeypatch.setattr(selection, "KVZIP_CHUNK", 128)
    got = selection.score_prompt(model, variables, data["plain_ids"], "reconstruction",
                                 instruction=kvzip_instruction(meta, "plain"))
    want = data["plain_kvzip_chunk128_scores"].astype(np.float64)
    assert head_errors(got[..., :128], want[..., :128]).max() <= SCORE_TOL
    second = head_errors(got[..., 128:], want[..., 128:])
    assert np.median(second) > 100 * SCORE_TOL  # not the same definition (measured median 0.27)
    assert correlation(got[..., 128:], want[..., 128:]) > 0.9  # but close (measured 0.955)


def correlation(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rank correlation of the two flattened arrays."""
    ra, rb = (np.argsort(np.argsort(x.ravel())) for x in (a, b))
    return float(np.corrcoef(ra, rb)[0, 1])


def test_reconstruction_after_a_chat_prefix_differs_from_kvzip_only_by_the_prefix(ours, ref):
    """kvpress's KVzip leaves the chat template's prefix out of the re-read (score 0 past the sinks);
    linicl re-reads all it is given. The context's scores stay correlated."""
    data, meta = ref
    p = meta["chat_prefix_length"]
    got = ours("chat", "reconstruction", instruction=kvzip_instruction(meta, "chat"))
    want = data["chat_kvzip_scores"].astype(np.float64)
    assert (want[..., :p] == 0).all() and (got[..., SINKS:p] > 0).all()
    for tag in RATIOS:
        assert not data[f"chat_kvzip_kept{tag}"][..., SINKS:p].any()  # the prefix goes first
    assert correlation(got[..., p:], want[..., p:]) > 0.85  # measured 0.92
    assert np.median(head_errors(got[..., p:], want[..., p:])) > 100 * SCORE_TOL  # measured 0.37


# ------------------------------------------------------------------------------ power
def test_the_comparisons_have_power(ours, ref):
    """Shuffled scores (each head's tokens permuted) fail the score and kept-set checks by far."""
    data, _ = ref
    got = ours("plain", "expected").copy()
    want = data["plain_expected_scores"].astype(np.float64)
    got[..., SINKS:] = np.random.default_rng(0).permuted(got[..., SINKS:], axis=-1)
    assert head_errors(got[..., SINKS:], want[..., SINKS:]).min() > 100 * SCORE_TOL
    n = got.shape[-1]
    for tag, ratio in RATIOS.items():
        kept, theirs = uniform(got, n_kept(n, ratio), sinks=SINKS), data[f"plain_expected_kept{tag}"]
        missed = unexplained(kept, theirs, want, per_head=True, forced=forced_mask(n, SINKS))
        assert missed > 0.2 * (theirs.sum() - SINKS * theirs[..., 0].size)
