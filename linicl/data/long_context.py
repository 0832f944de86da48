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

import re
from typing import Optional, Sequence

import numpy as np

from linicl.data.datasets import Example, load_task
from linicl.data.prompts import (BOS, DEMO_INPUT, INSTRUCTION, QUERY, Prompt, TextEncoder, _bos, _encode,
                                 build_eval_set)
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


def passkey_prompt(tokenizer: TextEncoder, filler: np.ndarray, n_tokens: int, key: str, depth: float, *,
                   start: int = 0, add_bos: Optional[bool] = None) -> Prompt:
    """One passkey prompt of exactly ``n_tokens`` tokens, its key line after ``depth`` (in [0, 1]) of
    the filler, the filler read from ``filler[start:]``."""
    if not 0.0 <= depth <= 1.0:
        raise LiniclError(f"depth must be in [0, 1] (the share of the filler before the key), got {depth!r}")
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
    [0, 1], filler from random places of the stream; deterministic in ``seed``."""
    if not isinstance(n, int) or n < 1 or not isinstance(digits, int) or not 1 <= digits <= 12:
        raise LiniclError(f"passkey_prompts needs n >= 1 and 1 <= digits <= 12, got n={n!r}, digits={digits!r}")
    rng = np.random.default_rng(seed)
    return [passkey_prompt(tokenizer, filler, n_tokens, _key(rng, digits), float(rng.uniform()),
                           start=int(rng.integers(len(filler))), add_bos=add_bos) for _ in range(n)]


def kv_recall_prompt(tokenizer: TextEncoder, filler: np.ndarray, n_tokens: int, pairs: Sequence[tuple],
                     asked: int, *, start: int = 0, add_bos: Optional[bool] = None) -> Prompt:
    """One prompt of exactly ``n_tokens`` tokens: the ``(name, key)`` lines of ``pairs`` spread evenly
    through the filler (line j after (j + 1) / (len(pairs) + 1) of it), then the question for
    ``pairs[asked]``."""
    if not pairs or not 0 <= asked < len(pairs):
        raise LiniclError(f"kv_recall_prompt needs pairs and 0 <= asked < len(pairs), got {len(pairs)} pairs, "
                          f"asked={asked!r}")
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
    (from ``KV_NAMES``) and random ``digits``-digit codes, one asked (uniform); deterministic in ``seed``."""
    if not isinstance(n_pairs, int) or not 1 <= n_pairs <= len(KV_NAMES):
        raise LiniclError(f"n_pairs must be an int in [1, {len(KV_NAMES)}], got {n_pairs!r}")
    if not isinstance(n, int) or n < 1:
        raise LiniclError(f"kv_recall_prompts needs n >= 1, got {n!r}")
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        names = rng.choice(len(KV_NAMES), size=n_pairs, replace=False)
        pairs = [(KV_NAMES[i], _key(rng, digits)) for i in names]
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
    if not isinstance(n, int) or n < 1 or not isinstance(length, int) or length < 1:
        raise LiniclError(f"filler_windows needs ints n >= 1 and length >= 1, got n={n!r}, length={length!r}")
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


__all__ = ["key_answered", "filler_stream", "passkey_prompt", "passkey_prompts", "kv_recall_prompt", "kv_recall_prompts",
           "probe_prompts", "many_shot_prompts", "filler_windows", "key_line",
           "PASSKEY_INSTRUCTION", "PASSKEY_LINE", "PASSKEY_QUESTION", "KV_INSTRUCTION", "KV_LINE", "KV_QUESTION",
           "KV_NAMES"]
