"""Selections of a long prompt's exact keys and values (``convert_approx(keep=...)``) evaluated on the
long-prompt probes (``linicl.data.long_context``): the question read alone after a prompt that keeps
only what its scores chose, against the prompted model.

``select_prompt`` does one prompt: its context (all but the question) converted whole and exact once,
each score computed once (``selection.score_prompt``), then for every (score, budget) the kept set
(``selection.allocate``), the cut conversion (``iclca.keep_only``) and the greedy answer to the
question. ``selected_rows`` gathers the prompts of a cell into one ``scored_row`` per method, named
``"<score>@<keep>"`` (``method_name``). Each budget's "recent" method is StreamingLLM at that budget:
the sliding window (with sinks) holding exactly as many floats.

``prefix_loss`` does one held-out text: its first tokens converted under every (score, budget), and the
next-token loss of the text that follows them, read alone after the kept entries, against the whole
prefix kept exact (the prompted model) and against no prefix at all; ``loss_rows`` pools the texts
with paired intervals and ``loss_table`` writes them.
"""

from __future__ import annotations

import time
from typing import Mapping, Optional, Sequence

import jax.numpy as jnp
import numpy as np

from linicl import iclca, selection, stats
from linicl.data import long_context as lc
from linicl.errors import BudgetError, LiniclError
from linicl.evaluate import greedy_answers, normalise_answer
from linicl.linearize.quality import next_token_loss
from linicl.names import ALLOCATIONS, POSITIONLESS_SCORES, PROMPT_APPROX, SELECTION_SCORES
from linicl.reporting import markdown_table

__all__ = ["QUESTION", "FULL", "NO_PREFIX", "method_name", "select_prompt", "selected_rows", "selection_table",
           "plot_budgets", "prefix_loss", "loss_rows", "loss_table"]

# SnapKV observing the real question (its original, query-aware form): a reference for what attention
# can select when the query is known. Not a conversion: a converted prompt never sees its later query.
QUESTION = "snapkv+question"
# prefix_loss's references: the whole prefix kept exact (the prompted model) and no prefix at all.
FULL, NO_PREFIX = "full", "no prefix"


def method_name(score: str, keep, allocation: Optional[str] = None, kernel: Optional[str] = None) -> str:
    """``"reconstruction@0.1"``: a score at a budget (a float share of the KV, or an int of tokens per
    KV head) with the score's default allocation; ``"reconstruction:heads@0.1"`` with another;
    ``"reconstruction@0.1+learned"`` when what is not kept is stored as that kernel's terms."""
    other = allocation is not None and allocation != selection.default_allocation(score)
    return f"{score}{':' + allocation if other else ''}@{keep:g}" + (f"+{kernel}" if kernel else "")


def _allocations(score: str, allocations: Sequence[str]) -> list:
    """The allocations a score runs with: its default, then the others asked for that apply to it."""
    default = selection.default_allocation(score)
    if score in POSITIONLESS_SCORES:
        return [default]
    return [default] + [a for a in allocations if a != default]


def _check(scores: Sequence[str], keeps: Sequence) -> None:
    bad = [s for s in scores if s not in SELECTION_SCORES]
    if bad or not scores:
        raise LiniclError(f"scores must be a non-empty list of {SELECTION_SCORES}, got {list(scores)}")
    if not keeps:
        raise LiniclError("keeps must name at least one budget")


def select_prompt(model, variables, prompt, tokenizer, *, scores: Sequence[str], keeps: Sequence,
                  sinks: int = 4, window: int = 16, instruction=None, max_new: int = 8, chunk: int = 512,
                  seed: int = 0, span: Optional[tuple] = None, allocations: Sequence[str] = (),
                  question_aware: bool = False, kernels: Optional[Mapping[str, Mapping]] = None) -> dict:
    """One ``linicl.data.Prompt`` under every (score, budget): ``dict(answers={method: answer},
    floats={method: kept floats}, line_kept={method: share} (with ``span``, e.g. a passkey prompt's
    ``long_context.key_line``: the share of that span's (layer, KV head, token) entries kept),
    seconds={"prefill": the whole conversion, score: its selection pass})``. Each score runs with its
    default allocation and each of ``allocations`` that applies to it (``method_name``). With
    ``question_aware``, also ``QUESTION``: SnapKV whose observation window is the prompt's own question
    (the query-aware reference; it reads the query a conversion may not)."""
    if any(a not in ALLOCATIONS for a in allocations):
        raise LiniclError(f"allocations must be names of {ALLOCATIONS}, got {list(allocations)}")
    _check(scores, keeps)
    cfg = model.cfg
    ctx, question = np.asarray(prompt.tokens[:prompt.query_start]), list(prompt.tokens[prompt.query_start:])
    n = len(ctx)
    t0 = time.perf_counter()
    whole = iclca.convert_approx(model, variables, jnp.asarray(ctx)[None], "none", sinks=n, window=0)
    seconds = {"prefill": time.perf_counter() - t0}
    out = dict(answers={}, floats={}, line_kept={}, seconds=seconds)
    for score in list(scores) + ([QUESTION] if question_aware else []):
        t0 = time.perf_counter()
        # The instruction is reconstruction's re-read instruction; snapkv's window stays the prompt's end
        # unless it is the query-aware reference, which observes the question itself.
        extra = {"reconstruction": instruction, QUESTION: question}.get(score)
        got = selection.score_prompt(model, variables, ctx, "snapkv" if score == QUESTION else score, chunk=chunk,
                                     sinks=sinks, instruction=extra, seed=seed)
        seconds[score] = time.perf_counter() - t0
        for keep, allocation in ((k, a) for a in _allocations(score, allocations) for k in keeps):
            name = method_name(score, keep, allocation)
            kept = selection.allocate(got, selection.token_budget(cfg, n, keep), sinks=sinks, window=window,
                                      allocation=allocation)
            conv = iclca.keep_only(whole, kept, size=n)  # one query shape for every score and budget
            out["answers"][name] = greedy_answers(model, conv, tokenizer, [question], max_new=max_new,
                                                  common=dict(batch_size=1, progress=False))[0]
            out["floats"][name] = iclca.stored_floats(conv)["kept"]
            if span is not None:
                out["line_kept"][name] = float(kept[:, :, span[0]:span[1]].mean())
            select = dict(keep=keep, score="snapkv" if score == QUESTION else score, scores=got,
                          allocation=allocation, sinks=sinks, window=window, size=n)
            for kname, kw in (kernels or {}).items():
                _with_kernel(out, model, variables, ctx, question, tokenizer,
                             method_name(score, keep, allocation, kname), kw, select, max_new, span)
    return out


def _with_kernel(out: dict, model, variables, ctx, question, tokenizer, name: str, kw: Mapping, select: dict,
                 max_new: int, span: Optional[tuple]) -> None:
    """One selection whose dropped tokens are a kernel's terms: its answer, its stored floats (kept
    entries and kernel terms) and, with ``span``, the span's kept share into ``out``."""
    if "kernel" not in kw:
        raise LiniclError(f"kernels[{name!r}] must name its kernel (convert_approx keyword arguments), got {dict(kw)}")
    try:
        conv = iclca.convert_approx(model, variables, jnp.asarray(ctx)[None], **kw, **select)
    except BudgetError:
        return  # the budget cannot hold the kernel's terms and the forced tokens: no such method here
    out["answers"][name] = greedy_answers(model, conv, tokenizer, [question], max_new=max_new,
                                          common=dict(batch_size=1, progress=False))[0]
    floats = iclca.stored_floats(conv)
    out["floats"][name] = floats["kept"] + floats["kernel"]
    if span is not None:  # each head's kept positions (padding -1) within the span, over layers and heads
        pos = np.stack([np.asarray(a["attn"]["approx"].sink_pos[0]) for a in conv[PROMPT_APPROX].values()])
        inside = (pos >= span[0]) & (pos < span[1])
        out["line_kept"][name] = float(inside.sum() / (pos.shape[0] * pos.shape[1] * (span[1] - span[0])))


def selected_rows(records: Sequence[Mapping], prompts: Sequence, *, keyed: bool) -> dict:
    """``{method: row}`` over a cell's prompts from their ``select_prompt`` records (in prompt order):
    ``accuracy``, ``wilson``, ``correct``, ``predictions`` and ``n`` as ``long_prompts.scored_row``
    writes them, plus ``state_floats`` (the largest over the prompts), ``line_kept`` (mean, passkey),
    ``score_s`` and ``prefill_s`` (mean seconds) and ``score_per_prefill`` (their ratio)."""
    if len(records) != len(prompts) or not records:
        raise LiniclError(f"selected_rows needs one record per prompt, got {len(records)} records for "
                          f"{len(prompts)} prompts")
    rows = {}
    prefill = float(np.mean([r["seconds"]["prefill"] for r in records]))
    for name in (m for m in records[0]["answers"] if all(m in r["answers"] for r in records)):
        answers = [r["answers"][name] for r in records]
        if keyed:
            correct = np.asarray([lc.key_answered(a, p.label) for a, p in zip(answers, prompts)])
        else:
            correct = np.asarray([normalise_answer(a) == normalise_answer(p.label) for a, p in zip(answers, prompts)])
        score = name.split("@")[0].split(":")[0]
        score_s = float(np.mean([r["seconds"][score] for r in records]))
        row = dict(method=name, correct=correct.astype(int).tolist(), predictions=answers,
                   accuracy=float(correct.mean()), wilson=list(stats.wilson(int(correct.sum()), len(correct))),
                   n=len(correct), tokens=int(len(prompts[0])),
                   state_floats=int(max(r["floats"][name] for r in records)),
                   score_s=score_s, prefill_s=prefill, score_per_prefill=score_s / prefill)
        lines = [r["line_kept"][name] for r in records if name in r["line_kept"]]
        if lines:
            row["line_kept"] = float(np.mean(lines))
        rows[name] = row
    return rows


def _rows_of(scores: Sequence[str], allocations: Sequence[str], kernels: Sequence[str]) -> list:
    """``(score, allocation, kernel)`` of every table row: each score with its allocations, then again
    with each kernel's terms (``kernel`` None: what is not kept is dropped)."""
    base = [(s, a) for s in scores for a in _allocations(s, allocations)]
    return [(s, a, None) for s, a in base] + [(s, a, k) for k in kernels for s, a in base]


def selection_table(cells: Mapping[str, Mapping], scores: Sequence[str], keeps: Sequence,
                    allocations: Sequence[str] = (), kernels: Sequence[str] = ()) -> str:
    """Markdown: per keyed cell and score, accuracy % [95 % Wilson] at each budget, the paired
    difference against ``"recent"`` at that budget (the equal-state window; when it ran), the key
    line's kept share and the selection's seconds per prefill. ``cells``: the experiment's cells, each
    with ``probe``, ``tokens`` and ``selection`` (``selected_rows``)."""
    header = ["probe", "tokens", "score"] + [f"keep {k:g}" for k in keeps] + ["line kept", "time / prefill"]
    rows = []
    for key in sorted((k for k in cells if "selection" in cells[k]), key=lambda k: (cells[k]["probe"], cells[k]["tokens"])):
        c, sel = cells[key], cells[key]["selection"]
        for score, allocation, kernel in _rows_of(scores, allocations, kernels):
            cols = []
            for keep in keeps:
                r, ref = sel.get(method_name(score, keep, allocation, kernel)), sel.get(method_name("recent", keep))
                if r is None:
                    cols.append("-")
                    continue
                text = f"{100 * r['accuracy']:.0f} [{100 * r['wilson'][1]:.0f}, {100 * r['wilson'][2]:.0f}]"
                if ref is not None and (score, kernel) != ("recent", None):
                    d = stats.paired_bootstrap(r["correct"], ref["correct"])
                    text += f" ({100 * d[0]:+.0f} [{100 * d[1]:+.0f}, {100 * d[2]:+.0f}])"
                cols.append(text)
            first = sel.get(method_name(score, keeps[0], allocation), {})
            line = "; ".join(f"{sel[method_name(score, k, allocation)]['line_kept']:.2f}" for k in keeps
                             if "line_kept" in sel.get(method_name(score, k, allocation), {}))
            name = f"{score} ({allocation})" + (f" + {kernel} terms" if kernel else "")
            rows.append([c["probe"], c["tokens"], name] + cols + [line or "-",
                                                             f"{first.get('score_per_prefill', float('nan')):.2f}"])
    n = max((r["n"] for c in cells.values() for r in c.get("selection", {}).values()), default=0)
    return "\n".join([
        "Selection at conversion (softmax teacher; what a head does not keep is dropped, unless '+ <kernel> "
        f"terms'); accuracy % [95 % Wilson], n={n} per cell, and "
        "in brackets the paired difference against 'recent' at the same budget (the sliding window with sinks "
        "holding the same floats; 95 % bootstrap); line kept: the share of the passkey line's (layer, KV head, "
        "token) entries kept, per budget; time / prefill: the score's pass against one prefill of the context; "
        "'+ <kernel> terms': what a head does not keep stored as that kernel's terms, counted in the budget.",
        "", markdown_table(header, rows)])


def plot_budgets(ax_row, cells: Mapping[str, Mapping], scores: Sequence[str], keeps: Sequence,
                 allocations: Sequence[str] = (), kernels: Sequence[str] = ()) -> None:
    """Accuracy (95 % Wilson) against the budget, one axis per keyed cell with a selection, one line per
    score and allocation."""
    keys = sorted((k for k in cells if "selection" in cells[k]), key=lambda k: (cells[k]["probe"], cells[k]["tokens"]))
    for ax, key in zip(ax_row, keys):
        sel = cells[key]["selection"]
        for score, allocation, kernel in _rows_of(scores, allocations, kernels):
            pts = [(k, sel[method_name(score, k, allocation, kernel)]) for k in keeps
                   if method_name(score, k, allocation, kernel) in sel]
            if pts:
                x = [100 * k for k, _ in pts]
                ax.plot(x, [r["accuracy"] for _, r in pts], "o-" if kernel is None else "s--",
                        label=f"{score} ({allocation})" + (f" + {kernel}" if kernel else ""))
                ax.fill_between(x, [r["wilson"][1] for _, r in pts], [r["wilson"][2] for _, r in pts], alpha=0.1)
        ax.set(xscale="log", xlabel="kept % of the context's KV floats", ylabel="accuracy (95 % Wilson)",
               title=f"{cells[key]['probe']} {cells[key]['tokens']} tokens", ylim=(-0.02, 1.02))
    if keys:
        ax_row[0].legend(fontsize=7)


def _continuation_nll(model, variables, continuation: np.ndarray) -> float:
    """Mean next-token NLL (nats) of ``continuation[1:]`` read after what ``variables`` hold."""
    return next_token_loss(model, variables, continuation[None], batch_size=1, buckets=(0,))["mean"]


def prefix_loss(model, variables, row, prefix: int, *, scores: Sequence[str], keeps: Sequence, sinks: int = 4,
                window: int = 16, instruction=None, chunk: int = 512, seed: int = 0) -> dict:
    """One held-out text ``row: int[prefix + t]`` (t >= 2): its first ``prefix`` tokens converted under
    every (score, budget) of ``scores`` x ``keeps`` (each score once, ``selection.score_prompt``; its
    default allocation; the ``sinks`` first and ``window`` last prefix tokens always kept; the rest
    dropped), and the mean next-token NLL of the t - 1 later tokens the continuation predicts from
    itself, read alone after what was kept. Returns ``dict(nll={method: nats}, floats={method: kept
    floats}, seconds={"prefill": the whole conversion, score: its pass})`` with the methods
    ``method_name(score, keep)``, ``FULL`` (the whole prefix exact: the prompted model) and
    ``NO_PREFIX`` (the continuation alone: what the prefix is worth)."""
    _check(scores, keeps)
    row = np.asarray(row)
    if row.ndim != 1 or not np.issubdtype(row.dtype, np.integer):
        raise LiniclError(f"row must be int[prefix + t], got {row.dtype}{list(row.shape)}")
    if isinstance(prefix, bool) or not isinstance(prefix, (int, np.integer)) or not 0 < prefix <= len(row) - 2:
        raise LiniclError(f"prefix must be an int in [1, len(row) - 2 = {len(row) - 2}] (the continuation "
                          f"needs two tokens to predict one), got {prefix!r}")
    ctx, cont = row[:prefix].astype(np.int32), row[prefix:].astype(np.int32)
    t0 = time.perf_counter()
    whole = iclca.convert_approx(model, variables, jnp.asarray(ctx)[None], "none", sinks=prefix, window=0)
    seconds = {"prefill": time.perf_counter() - t0}
    out = dict(nll={FULL: _continuation_nll(model, whole, cont), NO_PREFIX: _continuation_nll(model, variables, cont)},
               floats={FULL: iclca.stored_floats(whole)["kept"], NO_PREFIX: 0}, seconds=seconds)
    for score in scores:
        t0 = time.perf_counter()
        got = selection.score_prompt(model, variables, ctx, score, chunk=chunk, sinks=sinks,
                                     instruction=instruction if score == "reconstruction" else None, seed=seed)
        seconds[score] = time.perf_counter() - t0
        for keep in keeps:
            name = method_name(score, keep)
            kept = selection.allocate(got, selection.token_budget(model.cfg, prefix, keep), sinks=sinks,
                                      window=window, allocation=selection.default_allocation(score))
            conv = iclca.keep_only(whole, kept, size=prefix)  # one query shape for every score and budget
            out["nll"][name] = _continuation_nll(model, conv, cont)
            out["floats"][name] = iclca.stored_floats(conv)["kept"]
    return out


def loss_rows(records: Sequence[Mapping]) -> dict:
    """``{method: row}`` over the texts' ``prefix_loss`` records: ``mean`` NLL (nats), ``per_text``,
    ``n``, ``state_floats`` (the largest), and the paired mean differences (95 % bootstrap over texts)
    ``vs_full`` (against the whole prefix; the target reads it) and, for a selection, ``vs_recent``
    (against the sliding window of the same floats)."""
    if not records:
        raise LiniclError("loss_rows needs at least one prefix_loss record")
    per = {m: np.asarray([r["nll"][m] for r in records]) for m in records[0]["nll"]}
    rows = {}
    for m, x in per.items():
        row = dict(mean=float(x.mean()), per_text=x.tolist(), n=len(x),
                   state_floats=int(max(r["floats"][m] for r in records)))
        if m != FULL:
            row["vs_full"] = list(stats.paired_bootstrap(x, per[FULL]))
        recent = f"recent@{m.split('@')[1]}" if "@" in m else None
        if recent in per and recent != m:
            row["vs_recent"] = list(stats.paired_bootstrap(x, per[recent]))
        rows[m] = row
    return rows


def loss_table(rows: Mapping[str, Mapping], prefix: int, tokens: int) -> str:
    """Markdown: each method's mean NLL of the text after a ``prefix``-token prefix (``tokens``
    continuation tokens), its difference from the whole prefix and from the equal-float window."""
    def iv(d):
        return "-" if d is None else f"{d[0]:+.3f} [{d[1]:+.3f}, {d[2]:+.3f}]"
    body = [[m, f"{r['mean']:.3f}", iv(r.get("vs_full")), iv(r.get("vs_recent")), f"{r['state_floats']:,}"]
            for m, r in rows.items()]
    n = max(r["n"] for r in rows.values())
    return "\n".join([
        f"Next-token loss (nats) of the {tokens} tokens after a {prefix}-token prefix kept by each selection, "
        f"n={n} texts; paired differences with 95 % bootstrap intervals against the whole prefix ('{FULL}', the "
        f"prompted model) and against 'recent' at the same budget (the equal-float window); '{NO_PREFIX}': the "
        "text read with no prefix.", "",
        markdown_table(["method", "loss", "vs full", "vs recent", "kept floats"], body)])
