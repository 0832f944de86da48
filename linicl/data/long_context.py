"""Long prompts of an exact token length: a passkey in natural filler text, and key-value lines
recalled after more text (multi-query associative recall written in words).

Both probe what a fixed-size state remembers from far back, where a sliding window has forgotten:

* **passkey** (Mohtashami & Jaggi's probe): an instruction, filler, one line stating a random
  ``digits``-digit key (twice), more filler, then the question; the answer is the key. The line sits
  at ``depth`` (the fraction of the filler before it; uniform over [0, 1] in ``passkey_prompts``).
* **key-value recall**: ``n_pairs`` lines "The code for <word> is <digits>." spread evenly through the
  filler; the question asks for one of them (uniform), after all the filler.

The filler is natural text (``filler_stream``: test-split inputs of a text task, shuffled and joined
by blank lines), tokenized once and cut to length, so every prompt of a call has exactly
``n_tokens`` tokens (BOS included): one compiled shape per length, and lengths that mean what they
say. The filler never contains a key line. Prompts are ``linicl.data.Prompt``-s whose ``label`` is the
key without its leading space; ``key_answered`` scores a generated answer (its first number must be the key).
Roles: BOS, INSTRUCTION (the instruction and the key lines), DEMO_INPUT (filler), QUERY (the question);
``key_line`` finds a passkey prompt's key line by them.

``probe_prompts`` builds either probe by name (``names.KEYED_PROBES``), ``many_shot_prompts`` the third
long prompt, k demonstrations of a word task shared by every query, and ``filler_windows`` cuts held-out
sequences from the filler (for next-token loss by position).
"""

from __future__ import annotations

import numbers
import re
from typing import Optional, Sequence

import numpy as np

from linicl.data.datasets import Example, load_task
from linicl.data.prompts import (BOS, DEMO_INPUT, INSTRUCTION, QUERY, Prompt, TextEncoder, _bos, _encode,
                                 build_eval_set)
from linicl._validate import check_index
from linicl.errors import LiniclError
from linicl.names import KEYED_PROBES

PASSKEY_INSTRUCTION = ("There is an important pass key hidden inside a lot of irrelevant text. Find it and "
                       "memorize it. I will quiz you about the pass key.\n\n")
PASSKEY_LINE = "\n\nThe pass key is {key}. Remember it. {key} is the pass key.\n\n"
PASSKEY_QUESTION = "\n\nWhat is the pass key? The pass key is"
KV_INSTRUCTION = ("Below, a few codes are hidden inside a lot of irrelevant text. Memorize every code. I "
                  "will quiz you about one of them.\n\n")
KV_LINE = "\n\nThe code for {name} is {key}.\n\n"
KV_QUESTION = "\n\nWhat is the code for {name}? The code for {name} is"
# Keys are drawn as int64 numbers below 10 ** digits; 12 digits fit with room to spare.
MAX_DIGITS = 12
# Names for the key-value lines: common, distinct, each a single word.
KV_NAMES = ("apple", "river", "tiger", "candle", "mirror", "garden", "rocket", "violin", "pepper", "castle",
            "forest", "button", "dragon", "pencil", "silver", "window", "anchor", "basket", "cactus", "falcon",
            "helmet", "island", "jacket", "ladder", "magnet", "needle", "orange", "parrot", "saddle", "tunnel",
            "wallet", "yogurt")


def key_answered(answer: str, key: str) -> bool:
    """Whether a generated ``answer`` gives ``key``: its first run of digits is the key (a model may go
    on after it, e.g. " 86556. Remember it", which exact match of the whole answer would count wrong)."""
    digits = re.search(r"\d+", answer)
    return digits is not None and digits.group() == key


def filler_stream(tokenizer: TextEncoder, *, task: str = "agnews", split: str = "test", seed: int = 0,
                  min_tokens: int = 0, data_dir=None) -> np.ndarray:
    """``int32[N]``: the inputs of ``task``'s ``split`` (natural text), shuffled with ``seed`` and joined
    by blank lines, tokenized. Raises when it holds fewer than ``min_tokens`` tokens."""
    loaded = load_task(task, data_dir)
    rows = getattr(loaded, split, None)
    if not rows:
        raise LiniclError(f"filler_stream: task {task!r} has no {split!r} rows to use as filler text")
    order = np.random.default_rng(seed).permutation(len(rows))
    ids = np.asarray(_encode(tokenizer, "\n\n".join(rows[i].input for i in order)), np.int32)
    if len(ids) < min_tokens:
        raise LiniclError(f"filler_stream: the {split} split of {task!r} holds {len(ids)} tokens of text, "
                          f"fewer than the {min_tokens} needed")
    return ids


# The passkey test's original filler (Mohtashami & Jaggi, arXiv 2305.16300): five sentences repeated, so
# that the key line is the one novel thing in the prompt.
CLASSIC_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def classic_filler(tokenizer: TextEncoder, *, min_tokens: int = 0) -> np.ndarray:
    """``int32[N]``: ``CLASSIC_FILLER`` repeated and tokenized, at least ``min_tokens`` tokens (plus one
    repetition, so a prompt's filler window may start anywhere). The easy haystack of the original
    passkey test: every filler sentence occurs many times, the key line once. ``filler_stream`` is the
    hard one (natural text, every sentence novel)."""
    min_tokens = _check_int("classic_filler", "min_tokens", min_tokens, 0)
    once = len(_encode(tokenizer, CLASSIC_FILLER))
    if once == 0:
        raise LiniclError("classic_filler: the tokenizer encodes the filler sentence to no tokens")
    return np.asarray(_encode(tokenizer, CLASSIC_FILLER * (min_tokens // once + 2)), np.int32)


def _check_int(what: str, name: str, value, lo: Optional[int] = None, hi: Optional[int] = None) -> int:
    """``value`` as an int in [lo, hi] (None: no bound). NumPy ints are accepted; a bool (True would
    count as 1) and a float (which slicing and ``range`` would refuse or truncate) are not."""
    ok = isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
    if not ok or (lo is not None and value < lo) or (hi is not None and value > hi):
        want = ("an int" if lo is None else f"an int in [{lo}, {hi}]" if hi is not None
                else f"an int with {name} >= {lo}")
        raise LiniclError(f"{what}: {name} must be {want}, got {value!r}")
    return int(value)


def _check_digits(what: str, digits) -> int:
    """The number of digits of a key: 0 would make every key "0", and more than ``MAX_DIGITS`` leaves
    NumPy's int64 range (raw NumPy errors at 19 and beyond)."""
    return _check_int(what, "digits", digits, 1, MAX_DIGITS)


def _check_filler(what: str, filler) -> np.ndarray:
    """The filler as a 1-d integer array of token ids: a float array would be cast (truncated) to
    int32 ids without a word."""
    arr = np.asarray(filler)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise LiniclError(f"{what}: filler must be a 1-d array of int token ids (filler_stream), got dtype "
                          f"{arr.dtype} and shape {arr.shape}")
    return arr


def _check_key(what: str, key) -> str:
    """A key must be a string of ASCII digits: ``key_answered`` compares it with the answer's first number,
    so an int key would never be answered."""
    if not isinstance(key, str) or not re.fullmatch(r"[0-9]+", key):
        raise LiniclError(f"{what}: a key must be a string of digits, e.g. '12345', got {key!r}")
    return key


def _check_length(n_tokens: int, fixed: int, what: str) -> int:
    """The filler budget of a prompt of ``n_tokens`` whose fixed parts take ``fixed`` tokens."""
    if not isinstance(n_tokens, (int, np.integer)) or isinstance(n_tokens, bool) or n_tokens <= fixed:
        raise LiniclError(f"{what}: n_tokens must be an int above the {fixed} tokens of the instruction, "
                          f"key lines and question, got {n_tokens!r}")
    return int(n_tokens) - fixed


def _assemble(tokenizer: TextEncoder, parts: Sequence[tuple], key: str, query: str) -> Prompt:
    """A Prompt from ``(ids, role)`` parts (the last one the question); its text decoded when the
    tokenizer can decode (BOS left out, as ``build_prompt`` does)."""
    tokens = np.concatenate([np.asarray(ids, np.int32) for ids, _ in parts])
    roles = np.concatenate([np.full(len(ids), role, np.int8) for ids, role in parts])
    decode = getattr(tokenizer, "decode", None)
    text = decode([int(t) for t, r in zip(tokens, roles) if r != BOS]) if decode else ""
    return Prompt(tokens=tokens, roles=roles, text=text, label=key, query_start=len(tokens) - len(parts[-1][0]),
                  demos=(), query=Example(query, key))


def _window(filler: np.ndarray, start: int, n: int) -> np.ndarray:
    if n > len(filler):
        raise LiniclError(f"the filler stream holds {len(filler)} tokens, fewer than the {n} a prompt needs "
                          f"(filler_stream(min_tokens=...) checks this up front)")
    start %= len(filler) - n + 1
    return filler[start:start + n]


def _key(rng: np.random.Generator, digits: int) -> str:
    return str(rng.integers(10 ** (digits - 1), 10 ** digits))


def _distinct_keys(rng: np.random.Generator, digits: int, n: int) -> list:
    """``n`` distinct ``digits``-digit keys: two lines with the same code would let a model that recalls
    the wrong line score. Drawn one by one, a repeat drawn again (the same keys as a plain draw whenever
    none repeats); the caller checks that ``n`` fit among the 9 * 10 ** (digits - 1) keys."""
    keys: list = []
    while len(keys) < n:
        key = _key(rng, digits)
        if key not in keys:
            keys.append(key)
    return keys


def passkey_prompt(tokenizer: TextEncoder, filler: np.ndarray, n_tokens: int, key: str, depth: float, *,
                   start: int = 0, add_bos: Optional[bool] = None) -> Prompt:
    """One passkey prompt of exactly ``n_tokens`` tokens, its key line after ``depth`` (in [0, 1]) of
    the filler, the filler read from ``filler[start:]`` (wrapping: any int ``start`` is taken modulo the room).

    Refused: a ``depth`` that is not a real number in [0, 1] (a bool or a string too), a ``key`` that is
    not a string of digits, ``filler`` that is not a 1-d int array, a ``start`` that is not an int."""
    if isinstance(depth, (bool, np.bool_)) or not isinstance(depth, numbers.Real) or not 0.0 <= depth <= 1.0:
        raise LiniclError(f"passkey_prompt: depth must be in [0, 1] (a real number: the share of the filler "
                          f"before the key), got {depth!r}")
    key = _check_key("passkey_prompt", key)
    filler = _check_filler("passkey_prompt", filler)
    start = _check_int("passkey_prompt", "start", start)
    bos, head = _bos(tokenizer, add_bos), _encode(tokenizer, PASSKEY_INSTRUCTION)
    line, question = _encode(tokenizer, PASSKEY_LINE.format(key=key)), _encode(tokenizer, PASSKEY_QUESTION)
    budget = _check_length(n_tokens, len(bos) + len(head) + len(line) + len(question), "passkey_prompt")
    text = _window(filler, start, budget)
    before = int(round(depth * budget))
    return _assemble(tokenizer, [(bos, BOS), (head, INSTRUCTION), (text[:before], DEMO_INPUT), (line, INSTRUCTION),
                                 (text[before:], DEMO_INPUT), (question, QUERY)], key, "pass key")


def passkey_prompts(tokenizer: TextEncoder, filler: np.ndarray, n_tokens: int, n: int, *, seed: int = 0,
                    digits: int = 5, add_bos: Optional[bool] = None) -> list:
    """``n`` passkey prompts of ``n_tokens`` tokens: random ``digits``-digit keys, depths uniform in
    [0, 1], filler from random places of the stream; deterministic in ``seed``. ``n`` must be an int
    >= 1, ``digits`` an int in [1, ``MAX_DIGITS``] (bools refused)."""
    n = _check_int("passkey_prompts", "n", n, 1)
    digits = _check_digits("passkey_prompts", digits)
    rng = np.random.default_rng(seed)
    return [passkey_prompt(tokenizer, filler, n_tokens, _key(rng, digits), float(rng.uniform()),
                           start=int(rng.integers(len(filler))), add_bos=add_bos) for _ in range(n)]


def _check_pairs(pairs) -> None:
    """``pairs`` must be a non-empty sequence of ``(name, key)`` string pairs with distinct names."""
    if isinstance(pairs, (str, bytes)) or not hasattr(pairs, "__len__") or len(pairs) == 0:
        raise LiniclError(f"kv_recall_prompt needs pairs: a non-empty list of (name, key) pairs, got {pairs!r}")
    for pair in pairs:
        if not isinstance(pair, (tuple, list)) or len(pair) != 2 or not isinstance(pair[0], str):
            raise LiniclError(f"kv_recall_prompt: pairs must hold (name, key) pairs of strings, got {pair!r}")
        _check_key("kv_recall_prompt", pair[1])
    names = [name for name, _ in pairs]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise LiniclError(f"kv_recall_prompt: pairs must have distinct names (the question for a repeated "
                          f"name has two answers), got {repeated} more than once")


def kv_recall_prompt(tokenizer: TextEncoder, filler: np.ndarray, n_tokens: int, pairs: Sequence[tuple],
                     asked: int, *, start: int = 0, add_bos: Optional[bool] = None) -> Prompt:
    """One prompt of exactly ``n_tokens`` tokens: the ``(name, key)`` lines of ``pairs`` spread evenly
    through the filler (line j after (j + 1) / (len(pairs) + 1) of it), then the question for
    ``pairs[asked]``.

    Refused: no pairs, a pair that is not ``(name, key)`` with a string name and a string of digits as
    key, two pairs with the same name (the question would be ambiguous), an ``asked`` that is not an
    int in [0, len(pairs)) (a bool or a float too), and the ``passkey_prompt`` refusals of ``filler``
    and ``start``. Two names may share a code here (``kv_recall_prompts`` draws them distinct)."""
    _check_pairs(pairs)
    asked = int(check_index("kv_recall_prompt: asked", asked, 0, len(pairs), "pairs, 0 <= asked < len(pairs)"))
    filler = _check_filler("kv_recall_prompt", filler)
    start = _check_int("kv_recall_prompt", "start", start)
    bos = _bos(tokenizer, add_bos)
    head = _encode(tokenizer, KV_INSTRUCTION)
    lines = [_encode(tokenizer, KV_LINE.format(name=name, key=key)) for name, key in pairs]
    question = _encode(tokenizer, KV_QUESTION.format(name=pairs[asked][0]))
    budget = _check_length(n_tokens, len(bos) + len(head) + sum(map(len, lines)) + len(question),
                           "kv_recall_prompt")
    text = _window(filler, start, budget)
    cuts = [int(round(budget * (j + 1) / (len(pairs) + 1))) for j in range(len(pairs))]
    parts, last = [(bos, BOS), (head, INSTRUCTION)], 0
    for cut, line in zip(cuts, lines):
        parts += [(text[last:cut], DEMO_INPUT), (line, INSTRUCTION)]
        last = cut
    parts += [(text[last:], DEMO_INPUT), (question, QUERY)]
    return _assemble(tokenizer, parts, pairs[asked][1], pairs[asked][0])


def kv_recall_prompts(tokenizer: TextEncoder, filler: np.ndarray, n_tokens: int, n: int, *, n_pairs: int = 8,
                      seed: int = 0, digits: int = 4, add_bos: Optional[bool] = None) -> list:
    """``n`` key-value recall prompts of ``n_tokens`` tokens, each with ``n_pairs`` distinct names
    (from ``KV_NAMES``) and distinct random ``digits``-digit codes, one asked (uniform); deterministic in
    ``seed``. ``n`` must be an int >= 1, ``n_pairs`` an int in [1, len(KV_NAMES)] and ``digits`` an int in
    [1, ``MAX_DIGITS``] with room for ``n_pairs`` distinct codes (bools refused)."""
    n_pairs = _check_int("kv_recall_prompts", "n_pairs", n_pairs, 1, len(KV_NAMES))
    n = _check_int("kv_recall_prompts", "n", n, 1)
    digits = _check_digits("kv_recall_prompts", digits)
    if n_pairs > 9 * 10 ** (digits - 1):
        raise LiniclError(f"kv_recall_prompts: n_pairs={n_pairs} distinct codes do not fit among the "
                          f"{9 * 10 ** (digits - 1)} codes of digits={digits}; use more digits")
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        names = rng.choice(len(KV_NAMES), size=n_pairs, replace=False)
        pairs = list(zip((KV_NAMES[i] for i in names), _distinct_keys(rng, digits, n_pairs)))
        out.append(kv_recall_prompt(tokenizer, filler, n_tokens, pairs, int(rng.integers(n_pairs)),
                                    start=int(rng.integers(len(filler))), add_bos=add_bos))
    return out



def probe_prompts(probe: str, tokenizer: TextEncoder, filler: np.ndarray, n_tokens: int, n: int, *, seed: int = 0,
                  n_pairs: int = 8) -> list:
    """``n`` prompts of exactly ``n_tokens`` tokens of a keyed probe (``names.KEYED_PROBES``):
    ``"passkey"`` (``passkey_prompts``) or ``"kv"`` (``kv_recall_prompts`` with ``n_pairs`` lines);
    deterministic in ``seed``. Either is scored by ``key_answered``."""
    if probe == "passkey":
        return passkey_prompts(tokenizer, filler, n_tokens, n, seed=seed)
    if probe == "kv":
        return kv_recall_prompts(tokenizer, filler, n_tokens, n, n_pairs=n_pairs, seed=seed)
    raise LiniclError(f"probe must be one of {KEYED_PROBES}, got {probe!r}")


def many_shot_prompts(tokenizer: TextEncoder, task: str, k: int, n: int, *, seed: int = 0, data_dir=None) -> list:
    """Many-shot ICL: ``n`` test queries of the word task ``task``, each after the same ``k``
    demonstrations (``build_eval_set`` with ``same_demos=True``: the long context is shared, only the
    query differs); deterministic in ``seed``. Scored by exact match (``linicl.evaluate``)."""
    return build_eval_set(load_task(task, data_dir), tokenizer, k=k, seed=seed, n_eval=n, same_demos=True)


def filler_windows(filler: np.ndarray, n: int, length: int, *, seed=0) -> np.ndarray:
    """``int32[n, length]``: ``n`` windows of the filler stream at uniform random starts (they may
    overlap), e.g. held-out text for next-token loss by position; deterministic in ``seed`` (anything
    ``np.random.default_rng`` takes)."""
    n = _check_int("filler_windows", "n", n, 1)
    length = _check_int("filler_windows", "length", length, 1)
    filler = _check_filler("filler_windows", filler)
    if len(filler) <= length:
        raise LiniclError(f"filler_windows: the filler holds {len(filler)} tokens, not more than length={length}; "
                          f"read a longer stream (filler_stream(min_tokens=...))")
    starts = np.random.default_rng(seed).integers(0, len(filler) - length, n)
    return np.stack([filler[s:s + length] for s in starts])


def key_line(prompt: Prompt) -> tuple:
    """``(start, end)``, the token span of a passkey prompt's key line: its last run of INSTRUCTION
    tokens (with the key at depth 0 the run also holds the opening instruction, a few more tokens)."""
    where = np.flatnonzero(np.asarray(prompt.roles) == INSTRUCTION)
    if where.size == 0:
        raise LiniclError("key_line: the prompt has no INSTRUCTION tokens; give a passkey prompt")
    gaps = np.flatnonzero(np.diff(where) > 1)
    start = where[gaps[-1] + 1] if gaps.size else where[0]
    return int(start), int(where[-1]) + 1


__all__ = ["key_answered", "filler_stream", "classic_filler", "CLASSIC_FILLER", "passkey_prompt", "passkey_prompts", "kv_recall_prompt", "kv_recall_prompts",
           "probe_prompts", "many_shot_prompts", "filler_windows", "key_line",
           "PASSKEY_INSTRUCTION", "PASSKEY_LINE", "PASSKEY_QUESTION", "KV_INSTRUCTION", "KV_LINE", "KV_QUESTION",
           "KV_NAMES", "MAX_DIGITS"]
