"""Training text for attention transfer that needs no network and never sees an evaluation query.

Few-shot prompts with every answer written out, built from the tasks' *training* splits (the
demonstration pools), are the text whose attention patterns matter most here (ICL). They are rendered
one after another into a token stream (shuffled, seeded) and cut into equal sequences. The same
function on ``split="test"`` gives held-out text for the next-token-loss comparison: it is read, never
trained on.

``sampled_sequences`` gives the other offline source: text sampled from the teacher itself
(data-free distillation), continuing given start tokens.

``retrieval_sequences`` gives long text with recall in it, for students that must remember beyond
their window: passkey and key-value prompts (``linicl.data.long_context``) in filler from a text
task's *training* split, each followed by its answer, so the teacher's attention retrieves a token
from far back at the end of every sequence.
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import numpy as np

from linicl.data import build_prompt, load_task, sample_demos, template_for
from linicl.data import long_context as lc
from linicl.data.prompts import _encode
from linicl.errors import LiniclError
from linicl.generation import generate


def _examples(task, split: str):
    if split not in ("train", "test"):
        raise LiniclError(f"split must be 'train' or 'test', got {split!r}")
    return getattr(task, split)


def _rendered(task, tokenizer, rng: np.random.Generator, split: str, max_shots: int) -> list:
    """One few-shot prompt with its answer: tokens of k demos, the query, and the query's answer."""
    pool = _examples(task, split)
    template = template_for(task)
    k = int(rng.integers(0, max_shots + 1))
    query = pool[int(rng.integers(len(pool)))]
    demos = [d for d in sample_demos(task, k + 1, [int(rng.integers(2**31)), 5], balanced=False) if d != query][:k]
    if split == "test":  # held-out text: its demonstrations come from the test split too
        demos = [pool[int(i)] for i in rng.integers(0, len(pool), size=k)]
    prompt = build_prompt(template, demos, query, tokenizer, add_bos=False)
    answer = _encode(tokenizer, template.label_prefix + query.output + "\n\n")  # continues: no BOS
    return list(prompt.tokens) + answer


def training_sequences(tokenizer, tasks: Sequence[str], *, n: int, length: int, seed: int = 0,
                       split: str = "train", data_dir=None, max_shots: int = 8,
                       bos: Optional[int] = None) -> np.ndarray:
    """``int32[n, length]``: a stream of rendered few-shot prompts of ``tasks`` (drawn in turn, seeded),
    cut into ``n`` sequences. ``bos``: a token id to start every sequence with (None: none)."""
    if n < 1 or length < 2:
        raise LiniclError(f"training_sequences needs n >= 1 and length >= 2, got n={n}, length={length}")
    loaded = [load_task(t, data_dir) for t in tasks]
    if not loaded:
        raise LiniclError("training_sequences: no tasks")
    rng = np.random.default_rng([seed, 13])
    body = length - (bos is not None)
    stream: list = []
    while len(stream) < n * body:
        stream += _rendered(loaded[int(rng.integers(len(loaded)))], tokenizer, rng, split, max_shots)
    rows = np.asarray(stream[:n * body], np.int32).reshape(n, body)
    if bos is not None:
        rows = np.concatenate([np.full((n, 1), bos, np.int32), rows], axis=1)
    return rows


def sampled_sequences(teacher, variables, starts, length: int, *, seed: int = 0, temperature: float = 1.0,
                      batch_size: int = 8) -> np.ndarray:
    """``int32[n, length]``: each row of ``starts: int[n, s]`` (e.g. a BOS token, or the first tokens of
    training prompts) continued by ``length - s`` tokens sampled from the teacher
    (``linicl.generate`` with a key per batch of rows drawn from ``seed``)."""
    starts = np.asarray(starts, np.int32)
    if starts.ndim != 2 or starts.shape[0] < 1 or starts.shape[1] < 1:
        raise LiniclError(f"starts must be int[n >= 1, s >= 1], got shape {starts.shape}")
    if not isinstance(length, int) or length <= starts.shape[1]:
        raise LiniclError(f"length must be an int above the start length {starts.shape[1]}, got {length!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise LiniclError(f"batch_size must be a positive int, got {batch_size!r}")
    rows = []
    for i in range(0, len(starts), batch_size):
        key = jax.random.PRNGKey(np.uint32(seed * 1_000_003 + i))
        new = generate(teacher, variables, starts[i:i + batch_size], length - starts.shape[1], key=key,
                       temperature=temperature)
        rows.append(np.concatenate([starts[i:i + batch_size], np.asarray(new, np.int32)], axis=1))
    return np.concatenate(rows)


def retrieval_sequences(tokenizer, *, n: int, length: int, seed: int = 0, data_dir=None, task: str = "agnews",
                        pairs: int = 4, add_bos: Optional[bool] = None) -> np.ndarray:
    """``int32[n, length]``: long sequences that end in a recall, alternately a passkey prompt and a
    key-value prompt with ``pairs`` lines (``linicl.data.long_context``), each followed by its answer
    (" <key>\n"), in filler text from ``task``'s training split (never the test split the probes read);
    depths, keys, names and filler windows seeded by ``seed``."""
    if n < 1:
        raise LiniclError(f"retrieval_sequences needs n >= 1, got {n!r}")
    filler = lc.filler_stream(tokenizer, task=task, split="train", seed=seed, min_tokens=length, data_dir=data_dir)
    rng = np.random.default_rng([seed, 29])
    rows = []
    for i in range(n):
        key = str(rng.integers(10_000, 100_000))
        answer = _encode(tokenizer, f" {key}\n")  # continues the prompt: no BOS
        start = int(rng.integers(len(filler)))
        if i % 2 == 0:
            prompt = lc.passkey_prompt(tokenizer, filler, length - len(answer), key, float(rng.uniform()),
                                       start=start, add_bos=add_bos)
        else:
            names = rng.choice(len(lc.KV_NAMES), size=pairs, replace=False)
            codes = [(lc.KV_NAMES[j], str(rng.integers(10_000, 100_000))) for j in names]
            asked = int(rng.integers(pairs))
            codes[asked] = (codes[asked][0], key)
            prompt = lc.kv_recall_prompt(tokenizer, filler, length - len(answer), codes, asked, start=start,
                                         add_bos=add_bos)
        rows.append(np.concatenate([prompt.tokens, np.asarray(answer, np.int32)]))
    return np.stack(rows).astype(np.int32)


def bos_for(tokenizer, add: Optional[bool] = None) -> Optional[int]:
    """The id every training and held-out row starts with (``training_sequences``' ``bos``): the
    tokenizer's BOS when ``add`` is True, none when False, and with ``add=None`` the tokenizer's own
    convention (``tokenizer.adds_bos``: Gemma starts with BOS, SmolLM2 does not)."""
    if add is not None and not isinstance(add, bool):
        raise LiniclError(f"add must be True, False or None (the tokenizer's convention), got {add!r}")
    add = tokenizer.adds_bos if add is None else add
    return tokenizer.bos_id if add else None


def training_text(teacher, variables, tokenizer, tasks: Sequence[str], *, n: int, length: int, seed: int = 0,
                  data_dir=None, bos: Optional[int] = None, sampled: int = 0) -> np.ndarray:
    """``int32[n + sampled, length]``: the stage-1 and stage-2 training text, ``training_sequences`` of
    ``tasks`` followed by ``sampled`` rows sampled from the teacher (``sampled_sequences``), each
    continuing the first 8 tokens of a training row drawn at random (seeded)."""
    if not isinstance(sampled, (int, np.integer)) or isinstance(sampled, bool) or sampled < 0:
        raise LiniclError(f"sampled must be a nonnegative int (rows sampled from the teacher), got {sampled!r}")
    seqs = training_sequences(tokenizer, tasks, n=n, length=length, seed=seed, data_dir=data_dir, bos=bos)
    if not sampled:
        return seqs
    rows = np.random.default_rng([seed, 17]).integers(0, len(seqs), sampled)
    return np.concatenate([seqs, sampled_sequences(teacher, variables, seqs[rows, :8], length, seed=seed)])
