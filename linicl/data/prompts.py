"""ICL prompts as token arrays with a per-token role mask.

A prompt is ``[BOS] [instruction sep] demo_1 sep ... demo_k sep query``, where a demo renders as
``input_prefix + input + io_sep + output_prefix + label_prefix + label`` and the query as
``input_prefix + input + io_sep + output_prefix`` (the model's next token is the label). With the
default ``Template()`` (the function-vectors format)::

    Q: hot\\nA: cold\\n\\nQ: big\\nA: small\\n\\nQ: up\\nA:

Every token gets a ``Role``: template text and separators are SEPARATOR, the demo inputs DEMO_INPUT,
the demo label words (with their leading space) DEMO_LABEL, and the whole query (its prefix, input and
trailing output prefix) QUERY. ``Prompt.query_start`` is the first QUERY token: everything before it is
the context that an exact conversion (``linicl.iclca.convert``) absorbs.

Tokenization is per segment: each run of same-role text is encoded separately and the ids are
concatenated, so that roles are exact. A BPE tokenizer may merge differently across a boundary when
it sees the whole text (GPT-2 encodes "\\n\\nQ" as "\\n", "\\n", "Q" but a lone "\\n\\n" as one token).
To keep boundaries natural, a space that ends a template piece is moved to the start of the input or
label after it ("Q: hot" -> "Q:" + " hot"), as word-initial spaces belong to the word in BPE.
``tokenization_mismatch`` reports the first position where the two tokenizations differ, and
``build_prompt(..., strict=True)`` refuses a prompt where they do. ``tokenization="whole"`` instead
encodes the whole text and finds each token's role by decoding; it refuses a token that straddles two
roles and a tokenizer whose ``decode`` does not reproduce the text.
"""

from __future__ import annotations

import string
from dataclasses import dataclass, field, replace
from enum import IntEnum
from typing import Protocol, Sequence

import numpy as np

from linicl.data.datasets import Example, Task
from linicl.errors import LiniclError


class Role(IntEnum):
    """Per-token role codes (stored as int8). PAD is 0 so that zero-filled arrays read as padding."""
    PAD = 0
    BOS = 1
    INSTRUCTION = 2
    SEPARATOR = 3  # template text: prefixes, separators between input/output and between examples
    DEMO_INPUT = 4
    DEMO_LABEL = 5
    QUERY = 6


PAD, BOS, INSTRUCTION, SEPARATOR, DEMO_INPUT, DEMO_LABEL, QUERY = Role


class TextEncoder(Protocol):
    """What the prompt builder needs. ``encode`` returns ids without special tokens. An optional
    attribute ``bos_id: int | None`` makes ``build_prompt`` prepend that id. One whose ``adds_bos`` is
    True (``linicl.lm.Tokenizer`` of a checkpoint that starts with BOS, whose ``encode`` then adds it
    by default, as HF's does) is called as ``encode(text, add_bos=False)``."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


Segment = tuple[str, Role]


@dataclass(frozen=True)
class Template:
    """How examples are written. ``input_format`` may name any field of the examples
    (``Example.field_map``), e.g. ``"{premise}\\nQuestion: {hypothesis}"``; its literal text is
    SEPARATOR. ``label_prefix`` is written before every label word (labels are scored as the first
    token of ``label_prefix + word``)."""
    input_prefix: str = "Q: "
    output_prefix: str = "A:"
    io_sep: str = "\n"
    example_sep: str = "\n\n"
    instruction: str = ""
    label_prefix: str = " "
    input_format: str = "{input}"

    def __post_init__(self):
        try:
            parts = list(string.Formatter().parse(self.input_format))
        except ValueError as e:
            raise LiniclError(f"Template.input_format {self.input_format!r} is not a format string: {e}")
        for _, name, spec, conv in parts:
            if name is not None and (not name.isidentifier() or spec or conv):
                raise LiniclError(f"Template.input_format {self.input_format!r}: slots must be plain "
                                  f"names like {{input}}, got {{{name}{'!' + conv if conv else ''}"
                                  f"{':' + spec if spec else ''}}}")

    def label_text(self, word: str) -> str:
        return self.label_prefix + word

    def _input(self, ex: Example, role: Role) -> list[Segment]:
        values = ex.field_map()
        out: list[Segment] = [(self.input_prefix, SEPARATOR)]
        for literal, name, _, _ in string.Formatter().parse(self.input_format):
            out.append((literal, SEPARATOR))
            if name is not None:
                if name not in values:
                    raise LiniclError(f"template slot {{{name}}} is not a field of the example (fields: "
                                      f"{sorted(values)}); pick a template for this task")
                out.append((values[name], role))
        out.append((self.io_sep + self.output_prefix, SEPARATOR))
        return out

    def segments(self, demos: Sequence[Example], query: Example,
                 demo_templates: Sequence[Template] | None = None) -> list[Segment]:
        """The prompt as (text, role) pieces; the query pieces are all QUERY. ``demo_templates``: one
        template per demonstration (a multi-task prompt, each demo written as its own task is), else
        this one for all."""
        if demo_templates is not None and len(demo_templates) != len(demos):
            raise LiniclError(f"demo_templates: expected one template per demonstration ({len(demos)}), got "
                              f"{len(demo_templates)}")
        segs: list[Segment] = []
        if self.instruction:
            segs += [(self.instruction, INSTRUCTION), (self.example_sep, SEPARATOR)]
        for i, ex in enumerate(demos):
            t = self if demo_templates is None else demo_templates[i]
            segs += t._input(ex, DEMO_INPUT)
            segs += [(t.label_text(ex.output), DEMO_LABEL), (self.example_sep, SEPARATOR)]
        segs += [(text, QUERY) for text, _ in self._input(query, QUERY)]
        return _normalise(segs)

    def render(self, demos: Sequence[Example], query: Example) -> str:
        return "".join(text for text, _ in self.segments(demos, query))


def _merge(segs: list[Segment]) -> list[Segment]:
    """Drop empty pieces and join neighbours with the same role."""
    out: list[Segment] = []
    for text, role in segs:
        if not text:
            continue
        if out and out[-1][1] == role:
            out[-1] = (out[-1][0] + text, role)
        else:
            out.append((text, role))
    return out


def _normalise(segs: list[Segment]) -> list[Segment]:
    """Merge same-role neighbours (fewer boundaries, fewer BPE differences) and move the trailing
    spaces of template text onto the demo input or label right after it."""
    segs = _merge(segs)
    for i in range(len(segs) - 1):
        (text, role), (nxt, nrole) = segs[i], segs[i + 1]
        if role in (SEPARATOR, INSTRUCTION) and nrole in (DEMO_INPUT, DEMO_LABEL):
            stripped = text.rstrip(" ")
            segs[i], segs[i + 1] = (stripped, role), (text[len(stripped):] + nxt, nrole)
    return _merge(segs)  # a separator of spaces only is now empty


# Ready-made templates. sst2/trec/agnews and the ICR suite (csqa ... ai2sci; mr uses sst2) follow the
# ICR paper's Table 6 (routing.md §4), with the template fields on separate lines (multiple choice:
# the options as lines "A. ...", then "Answer (A/B/...):"); cb is the GPT-3 / Zhao et al. (2021) "true,
# false, or neither" format; cb_abc the ICR paper's A/B/C format (task cb_abc); qa is the
# function-vectors format used for the word tasks.
TEMPLATES: dict[str, Template] = {
    "qa": Template(),
    "sst2": Template(input_prefix="Review: ", output_prefix="Sentiment:"),
    "trec": Template(input_prefix="Question: ", output_prefix="Answer Type:"),
    "agnews": Template(input_prefix="News: ", output_prefix="Type:"),
    "cb": Template(input_prefix="", input_format="{premise}\nQuestion: {hypothesis} true, false, or neither?",
                   output_prefix="Answer:"),
    "cb_abc": Template(input_prefix="", input_format="Premise: {premise}\nHypothesis: {hypothesis}\n"
                       "A. Entailment\nB. Contradiction\nC. Neutral", output_prefix="Answer (A/B/C):"),
    "csqa": Template(input_prefix="Question: ", input_format="{stem}\n{choices}", output_prefix="Answer (A/B/C/D/E):"),
    "piqa": Template(input_prefix="Goal: ", input_format="{goal}\nA. {sol1}\nB. {sol2}", output_prefix="Answer (A/B):"),
    "sst5": Template(input_prefix="Sentence: ", output_prefix="Sentiment:"),
    "mrpc": Template(input_prefix="", input_format="Sentence 1: {sentence1}\nSentence 2: {sentence2}\n"
                     "A. Paraphrase\nB. Not paraphrase", output_prefix="Answer (A/B):"),
    "copa": Template(input_prefix="Premise: ", input_format="{premise}\nWhat was the {question}?\nA. {choice1}\n"
                     "B. {choice2}", output_prefix="Answer (A/B):"),
    "creak": Template(input_prefix="Claim: ", output_prefix="Label:"),
    "ai2sci": Template(input_prefix="Question: ", input_format="{stem}\n{choices}", output_prefix="Answer (A/B/C/D):"),
}


def template_for(task: Task) -> Template:
    """The task's default template: the one its spec writes out (``task.template_fields``), else
    ``TEMPLATES[task.template]``."""
    if task.template_fields:
        try:
            return Template(**dict(task.template_fields))
        except TypeError as e:  # a field name Template does not have
            raise LiniclError(f"task {task.name!r}: template fields {dict(task.template_fields)} do not "
                              f"make a Template ({e})") from None
    if task.template not in TEMPLATES:
        raise LiniclError(f"task {task.name!r} names template {task.template!r}, not one of "
                          f"{sorted(TEMPLATES)}")
    return TEMPLATES[task.template]


# ----------------------------------------------------------------------------- demonstrations

def _check_k(k) -> int:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
        raise LiniclError(f"k must be an int >= 0 (number of demonstrations), got {k!r}")
    return int(k)


def _groups(task: Task, balanced: bool) -> list[np.ndarray]:
    """Indices into task.train per label (balanced classification), else one group of all."""
    if not (balanced and task.labels):
        return [np.arange(len(task.train))]
    outs = np.array([ex.output for ex in task.train], dtype=object)
    return [np.flatnonzero(outs == lab) for lab in task.labels]


def _sample(task: Task, groups: list[np.ndarray], k: int, rng: np.random.Generator,
            shuffle: bool) -> tuple[Example, ...]:
    if k > sum(len(g) for g in groups):
        raise LiniclError(f"k={k} demonstrations requested but task {task.name!r} has only "
                          f"{sum(len(g) for g in groups)} in its demo pool")
    if k and len(groups) > 1 and sum(len(g) > 0 for g in groups) < 2:
        only = next(task.labels[j] for j, g in enumerate(groups) if len(g))
        raise LiniclError(f"task {task.name!r}: class-balanced demonstrations need two or more classes, but "
                          f"every example of its demo pool (split 'train') has the label {only!r} of "
                          f"{list(task.labels)}; pass balanced=False to sample it as it is")
    if len(groups) == 1:
        return tuple(task.train[i] for i in rng.choice(groups[0], size=k, replace=False))
    # Round-robin over the labels in a seeded order; an exhausted label is skipped, so counts differ
    # by at most one until a small class runs out.
    queues = [list(rng.permutation(groups[j])) for j in rng.permutation(len(groups))]
    picks: list[int] = []
    while len(picks) < k:
        for q in queues:
            if q and len(picks) < k:
                picks.append(q.pop())
    if shuffle:  # without it the labels would cycle in a fixed pattern the model can copy
        picks = list(rng.permutation(picks))
    return tuple(task.train[i] for i in picks)


def sample_demos(task: Task, k: int, seed: int | Sequence[int], *, balanced: bool = True,
                 shuffle: bool = True) -> tuple[Example, ...]:
    """``k`` demonstrations from ``task.train``, deterministic in ``seed`` (anything
    ``np.random.default_rng`` accepts: an int or a sequence of ints >= 0).

    Classification tasks with ``balanced=True``: class-balanced, chosen round-robin over the labels in
    a seeded order (k=5 over 3 labels: 2, 2, 1), then shuffled unless ``shuffle=False`` (which keeps
    the round-robin order); a pool holding a single class is refused (k > 0). Otherwise a plain seeded
    sample without replacement.
    """
    return _sample(task, _groups(task, balanced), _check_k(k), np.random.default_rng(seed), shuffle)


def wrong_labels(demos: Sequence[Example], labels: Sequence[str], seed: int | Sequence[int]) -> tuple[Example, ...]:
    """``demos`` with each label replaced by another of ``labels``, drawn uniformly (seeded): prompts
    whose demonstrations no longer show the task's mapping (the corrupted prompts of function-vector
    head selection; random-label ICL). Every demo's label must be one of ``labels`` (two or more)."""
    labels = list(labels)
    if len(set(labels)) < 2:
        raise LiniclError(f"wrong_labels: labels must hold two or more distinct words, got {labels}")
    unknown = sorted({d.output for d in demos} - set(labels))
    if unknown:
        raise LiniclError(f"wrong_labels: demo labels {unknown} are not among labels {labels}")
    rng = np.random.default_rng(seed)
    out = []
    for d in demos:
        others = [w for w in labels if w != d.output]
        out.append(replace(d, output=others[int(rng.integers(len(others)))]))
    return tuple(out)


# ----------------------------------------------------------------------------- prompts

@dataclass(frozen=True, eq=False)
class Prompt:
    """One tokenized prompt. tokens int32[n], roles int8[n] (``Role`` codes); ``tokens[:query_start]``
    is the context (BOS, instruction, demonstrations), ``tokens[query_start:]`` the query; ``label`` is
    the expected label word (without ``label_prefix``); ``text`` the rendered prompt without BOS."""
    tokens: np.ndarray
    roles: np.ndarray
    text: str
    label: str
    query_start: int
    demos: tuple[Example, ...] = field(repr=False)
    query: Example = field(repr=False)

    def __len__(self) -> int:
        return len(self.tokens)

    def positions(self, role: Role) -> np.ndarray:
        """Indices int64[m] of the tokens with this role (e.g. DEMO_LABEL: where labels sit)."""
        return np.flatnonzero(self.roles == role)


def _encode(tokenizer: TextEncoder, text: str) -> list[int]:
    """Ids of ``text`` without special tokens: a segment or an answer, never a BOS of its own."""
    bare = tokenizer.encode(text, add_bos=False) if getattr(tokenizer, "adds_bos", False) else tokenizer.encode(text)
    ids = [int(i) for i in bare]
    if any(i < 0 or i > np.iinfo(np.int32).max for i in ids):
        raise LiniclError(f"tokenizer.encode({text[:40]!r}) returned ids outside int32 range >= 0")
    return ids


def _bos(tokenizer: TextEncoder, add_bos: bool | None) -> list[int]:
    """The BOS id to prepend: ``add_bos=None`` follows the tokenizer's own convention (its ``adds_bos``
    attribute: ``linicl.lm.Tokenizer`` has the checkpoint's; a tokenizer without one prepends its
    ``bos_id`` when it has one), True/False force it."""
    bos = getattr(tokenizer, "bos_id", None)
    if add_bos and bos is None:
        raise LiniclError("add_bos=True but the tokenizer has no bos_id (or it is None)")
    if add_bos is None:
        add_bos = getattr(tokenizer, "adds_bos", bos is not None)
    return [int(bos)] if add_bos else []


def _by_segment(segs: list[Segment], tokenizer: TextEncoder) -> tuple[list[int], list[int]]:
    tokens: list[int] = []
    roles: list[int] = []
    for text, role in segs:
        ids = _encode(tokenizer, text)
        tokens += ids
        roles += [role] * len(ids)
    return tokens, roles


def _by_whole_text(segs: list[Segment], tokenizer: TextEncoder) -> tuple[list[int], list[int]]:
    """Encode the whole text, then give each token the role of the characters it decodes to. Tokens
    are decoded in the smallest groups that reproduce the text (a character split over several byte
    tokens decodes only as a group); a group that straddles two roles is refused."""
    text = "".join(t for t, _ in segs)
    role_of_char = np.repeat([r for _, r in segs], [len(t) for t, _ in segs])
    tokens = _encode(tokenizer, text)
    roles = [0] * len(tokens)
    pos, group = 0, []
    for j in range(len(tokens)):
        group.append(j)
        piece = tokenizer.decode([tokens[i] for i in group])
        if not piece or not text.startswith(piece, pos):
            if len(group) > 8:
                break
            continue
        found = set(role_of_char[pos:pos + len(piece)].tolist())
        if len(found) > 1:
            raise LiniclError(f"tokenization='whole': token(s) {piece!r} at token {group[0]} straddle the "
                              f"roles {sorted(Role(r).name for r in found)}; use tokenization='segments'")
        role = found.pop()
        for i in group:
            roles[i] = role
        pos, group = pos + len(piece), []
    if group or pos != len(text):
        raise LiniclError(f"tokenization='whole': decoding the tokens one by one does not reproduce the "
                          f"text (stuck at character {pos}: {text[pos:pos + 20]!r}); this tokenizer's "
                          f"decode normalises text, use tokenization='segments'")
    return tokens, roles


def build_prompt(template: Template, demos: Sequence[Example], query: Example, tokenizer: TextEncoder,
                 *, add_bos: bool | None = None, strict: bool = False,
                 tokenization: str = "segments", demo_templates: Sequence[Template] | None = None) -> Prompt:
    """Tokenize ``demos`` + ``query`` (module docstring).

    demo_templates: one template per demonstration, for a multi-task prompt (the ICR paper's OOD
        few-shot baseline: demos of other tasks, each in its own format, before the query in
        ``template``); the separators between examples are ``template``'s.
    add_bos: prepend ``tokenizer.bos_id`` (None: when the tokenizer has one that is not None).
    tokenization: "segments" (default; exact roles for any tokenizer) encodes each same-role run
        separately; "whole" encodes the whole text as a model would see it in the wild and assigns
        roles by decoding, refusing a token that straddles two roles.
    strict: raise LiniclError unless the ids equal ``tokenizer.encode`` of the whole text.
    """
    if tokenization not in ("segments", "whole"):
        raise LiniclError(f"tokenization must be 'segments' or 'whole', got {tokenization!r}")
    segs = template.segments(demos, query, demo_templates)
    tokens, roles = (_by_segment if tokenization == "segments" else _by_whole_text)(segs, tokenizer)
    bos = _bos(tokenizer, add_bos)
    tokens, roles = bos + tokens, [BOS] * len(bos) + roles
    is_query = [r == QUERY for r in roles]
    # A query that renders as no tokens leaves everything as context.
    query_start = is_query.index(True) if any(is_query) else len(tokens)
    prompt = Prompt(np.asarray(tokens, np.int32), np.asarray(roles, np.int8), "".join(t for t, _ in segs),
                    query.output, query_start, tuple(demos), query)
    if strict and (i := tokenization_mismatch(prompt, tokenizer)) is not None:
        near = tokenizer.decode(prompt.tokens[i:i + 3].tolist())
        raise LiniclError(f"build_prompt(strict=True): per-segment tokens differ from encoding the whole "
                          f"text, first at token {i} ({near!r}); change the template's separators, use "
                          f"tokenization='whole', or drop strict")
    return prompt


def tokenization_mismatch(prompt: Prompt, tokenizer: TextEncoder) -> int | None:
    """First index where ``prompt.tokens`` differs from ``tokenizer.encode(prompt.text)`` (after any
    BOS), or None when they are equal."""
    n_bos = int(np.sum(prompt.roles == BOS))
    whole = _encode(tokenizer, prompt.text)
    mine = prompt.tokens[n_bos:].tolist()
    for i, (a, b) in enumerate(zip(mine, whole)):
        if a != b:
            return n_bos + i
    return None if len(mine) == len(whole) else n_bos + min(len(mine), len(whole))


def check_label_words(labels: Sequence[str], tokenizer: TextEncoder, *, prefix: str = " ") -> np.ndarray:
    """Token ids int32[n_labels] of ``prefix + word`` for each label word. Each must be exactly one
    token and the ids distinct (label-restricted scoring reads one logit per label); otherwise a
    LiniclError lists every offending word with its tokenization."""
    labels = list(labels)
    if not labels:
        raise LiniclError("check_label_words: labels is empty")
    encoded = {w: _encode(tokenizer, prefix + w) for w in labels}
    problems = [f"{prefix + w!r} -> {ids} {[tokenizer.decode([i]) for i in ids]}"
                for w, ids in encoded.items() if len(ids) != 1]
    if not problems:
        owners: dict[int, list[str]] = {}
        for w in labels:
            owners.setdefault(encoded[w][0], []).append(w)
        problems = [f"{[prefix + w for w in ws]} all -> [{i}]" for i, ws in owners.items() if len(ws) > 1]
    if problems:
        raise LiniclError("label words must each encode to exactly one distinct token (with prefix "
                          f"{prefix!r}); offending: " + "; ".join(problems)
                          + ". Choose other words (Task.relabel / load_task(label_words=...)).")
    return np.asarray([encoded[w][0] for w in labels], np.int32)


# ----------------------------------------------------------------------------- batches and eval sets

@dataclass(frozen=True, eq=False)
class PromptBatch:
    """Right-padded prompts. tokens int32[b, T], roles int8[b, T] (PAD after the end), lengths
    int32[b], query_start int32[b], labels: the expected label words. Right padding suits causal
    models: padding never affects real tokens, and row b's prediction is read at lengths[b] - 1."""
    tokens: np.ndarray
    lengths: np.ndarray
    roles: np.ndarray
    query_start: np.ndarray
    labels: tuple[str, ...]

    def label_index(self, labels: Sequence[str]) -> np.ndarray:
        """int32[b]: position of each row's label in ``labels`` (targets for label-restricted accuracy)."""
        labels = list(labels)
        missing = sorted(set(self.labels) - set(labels))
        if missing:
            raise LiniclError(f"label_index: labels {missing} of the batch are not in {labels}")
        return np.asarray([labels.index(lab) for lab in self.labels], np.int32)


def batch_prompts(prompts: Sequence[Prompt], pad_id: int = 0, *, pad_to: int | None = None) -> PromptBatch:
    """Stack prompts right-padded with ``pad_id`` to the longest one (or to ``pad_to``, e.g. a fixed
    length that keeps a jitted model from recompiling)."""
    if not prompts:
        raise LiniclError("batch_prompts: no prompts")
    lengths = np.asarray([len(p) for p in prompts], np.int32)
    width = int(lengths.max()) if pad_to is None else pad_to
    if width < lengths.max():
        raise LiniclError(f"pad_to={pad_to} is shorter than the longest prompt ({lengths.max()} tokens)")
    tokens = np.full((len(prompts), width), pad_id, np.int32)
    roles = np.full((len(prompts), width), PAD, np.int8)
    for b, p in enumerate(prompts):
        tokens[b, :len(p)], roles[b, :len(p)] = p.tokens, p.roles
    return PromptBatch(tokens, lengths, roles, np.asarray([p.query_start for p in prompts], np.int32),
                       tuple(p.label for p in prompts))


def build_eval_set(task: Task, tokenizer: TextEncoder, *, k: int, seed: int = 0, n_eval: int | None = None,
                   template: Template | None = None, same_demos: bool = False, balanced: bool = True,
                   add_bos: bool | None = None, tokenization: str = "segments") -> list[Prompt]:
    """Prompts for ``n_eval`` test queries (all when None or when the test set is smaller, as in the
    papers' "500 per dataset, all if fewer"; a seeded random subset otherwise), each with
    ``k`` demonstrations from ``sample_demos`` (their own per query, or one shared set when
    ``same_demos``). Deterministic in ``seed``; the template defaults to ``template_for(task)``."""
    k = _check_k(k)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise LiniclError(f"seed must be an int >= 0, got {seed!r}")
    if not task.test:  # an empty list of prompts would fail later, far from here (a rate of 0 of 0)
        raise LiniclError(f"task {task.name!r}: its evaluation set (split 'test') is empty: no query to "
                          f"build a prompt for")
    n = len(task.test) if n_eval is None else n_eval
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise LiniclError(f"n_eval must be an int >= 1 or None, got {n_eval!r}")
    template = template_for(task) if template is None else template
    # Separate streams for the query subset, shared demos and per-query demos.
    queries = np.random.default_rng([seed, 0]).permutation(len(task.test))[:n]
    groups = _groups(task, balanced)
    shared = _sample(task, groups, k, np.random.default_rng([seed, 1]), True) if same_demos else None
    out = []
    for j, qi in enumerate(queries):
        demos = shared if shared is not None else \
            _sample(task, groups, k, np.random.default_rng([seed, 2, j]), True)
        out.append(build_prompt(template, demos, task.test[qi], tokenizer, add_bos=add_bos,
                                tokenization=tokenization))
    return out


def shared_context(prompts: Sequence[Prompt]) -> tuple[int, np.ndarray, list]:
    """Prompts that share one demonstration context (``build_eval_set(..., same_demos=True)``) split
    into it and their queries: ``(n, context int32[n], [query int32[m_i]])`` with ``n`` the shared
    ``query_start``. Raises LiniclError when the prompts do not share their first ``n`` tokens."""
    if not prompts:
        raise LiniclError("shared_context: no prompts")
    n = prompts[0].query_start
    ctx = prompts[0].tokens[:n]
    for p in prompts:
        if p.query_start != n or not np.array_equal(p.tokens[:n], ctx):
            raise LiniclError("the prompts do not share one demonstration context")
    return n, ctx, [p.tokens[n:] for p in prompts]


def fit_queries(task: Task, tokenizer: TextEncoder, template: Template, exclude, m: int, target_len: int,
                seed: int) -> np.ndarray | None:
    """``int32[m', L]``: up to ``m`` query token rows (the query part of a zero-shot prompt) from the
    task's demo pool ``task.train`` (never the test split), none of the examples in ``exclude`` (a
    prompt's demos), all of one length L so that a fit on them sees no padding: the length with at
    least ``m`` candidates closest to ``target_len`` (the shorter on a tie), else the most frequent
    length (fewer rows). Candidates: up to max(400, 40 m) examples in a seeded random order. None when
    no candidate is left. (The inputs of ``iclca.convert_approx(..., fit_inputs=)``.)"""
    if m < 1:
        raise LiniclError(f"fit_queries: m must be >= 1, got {m}")
    rng = np.random.default_rng([seed, 11])
    by_len: dict = {}
    for i in rng.permutation(len(task.train))[:max(400, 40 * m)]:
        ex = task.train[i]
        if ex in exclude:
            continue
        p = build_prompt(template, (), ex, tokenizer, add_bos=False)
        row = p.tokens[p.query_start:]
        by_len.setdefault(len(row), []).append(row)
    if not by_len:
        return None
    full = [L for L, rows in by_len.items() if len(rows) >= m]
    L = (min(full, key=lambda x: (abs(x - target_len), x)) if full
         else max(by_len, key=lambda x: (len(by_len[x]), -x)))
    return np.stack(by_len[L][:m]).astype(np.int32)
