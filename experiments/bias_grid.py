"""ICLCA Fig. 1 searched over what the paper leaves unstated: a grid of settings of
``experiments/bias_training.py``, every arm on the same seeds, and a verdict per setting.

The caption says "the model with bias terms shows improved training speed and higher in-context
accuracy", with no sizes. One reconstruction cannot say whether the claim fails or the setting does, so
this runs a grid (24 induction settings and 4 of a task with shared facts by default):

* feature map: elu+1 (the paper's) / hedgehog (learned, positive);
* positions: none / learned / decay (per-head decays 0.8, 0.9, 0.95, 0.99, no positions);
* size: small (vocabulary 16, sequence 32, d_model 64) / large (vocabulary 256, sequence 128, d_model 128);
* learning rate: 1e-3 / 3e-3;

plus the ``facts`` task (16 keys a sequence from a fixed table of 32 facts shared by every sequence,
vocabulary 64, d_model 64: a persistent state has something to store) for each feature map with learned
or decay positions. Every setting runs the arms baseline, bias (b free), bias_nonneg (b >= 0),
bias_B_only (b = 0) and bias_warm (b >= 0, started from a converted demonstration instead of zero:
``iclca.to_trainable``), 2 layers, 1,000 steps of batch 16 and seeds 0, 1, 2 (``--steps``, ``--seeds``;
the other options as bias_training's defaults; ``--quick``: 20 steps unless ``--steps`` says otherwise,
and the report states the steps trained). The seeds are a set: in any order, the same run.

**Verdict.** For each bias arm and threshold (50 % and 90 % held-out in-context accuracy): the steps
the arm needs minus the baseline's, paired over seeds, with a Student-t 95 % interval
(``linicl.stats.paired_t``). A seed that never reaches the threshold counts as ``steps + eval_every``
(censored: the difference is then a bound, and the table says how many seeds reached it). An arm is
"sooner" in a setting when the interval lies below 0, "later" when above. The final in-context
accuracy is compared the same way ("higher", "lower"). The table's verdict names every significant
difference of an arm (to 90 %, to 50 %, final accuracy), "no difference" when there is none.

Each setting runs as its own ``bias_training.py`` process into ``OUT/<setting>/`` (checkpointed there);
its summary (``OUT/<setting>/summary.json``: steps to thresholds, final accuracies, accuracy curves) marks
it done (a summary that cannot be read, or is incomplete, is refused by name: delete it to rerun that
setting), so a stopped grid resumes where it stopped, and processes given disjoint ``--only`` lists can
share one OUT. Writes ``OUT/bias_grid.json`` and ``OUT/bias_grid.png`` over every setting once all are
done; before that ``OUT/bias_grid_partial.json`` and ``.png`` over the finished ones.

    python experiments/bias_grid.py               # the grid (hours on 2 cores; resumable)
    python experiments/bias_grid.py --quick       # 2 tiny settings (CI)
    python experiments/bias_grid.py --settings elu+1-decay-small-lr1e-3 --steps 4000 --out results/longer
                                                  # a smaller grid trained longer (its own OUT)
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

from tqdm.auto import tqdm

from linicl import reporting
from linicl.bias_training import FULL, QUICK
from linicl.errors import DataError, LiniclError
from linicl.reporting import positive_int
from linicl.stats import paired_t

SCRIPT = Path(__file__).resolve().parent / "bias_training.py"
BIAS_ARMS = ("bias", "bias_nonneg", "bias_B_only", "bias_warm")
THRESHOLDS = ("0.5", "0.9")
DECAYS = "0.8,0.9,0.95,0.99"
SIZES = {"small": dict(vocab=16, seq_len=32, d_model=64, d_ff=64),
         "large": dict(vocab=256, seq_len=128, d_model=128, d_ff=128)}


def settings(quick: bool) -> dict:
    """``{key: bias_training arguments}`` of the grid (two tiny settings with ``quick``)."""
    if quick:
        return {f"quick-{fm}": ["--quick", "--feature-map", fm] for fm in ("elu+1", "hedgehog")}
    grid = {}  # the settings most likely to learn the task first: a stopped grid has the informative ones
    for fm, pos in itertools.product(("elu+1", "hedgehog"), ("learned", "decay")):
        args = ["--task", "facts", "--n-facts", "32", "--n-pairs", "16", "--vocab", "64", "--d-model", "64",
                "--d-ff", "64", "--feature-map", fm, "--positions", "none" if pos == "decay" else pos]
        grid[f"facts-{fm}-{pos}"] = args + (["--decay", DECAYS] if pos == "decay" else [])
    for pos, fm, size, lr in itertools.product(("learned", "decay", "none"), ("elu+1", "hedgehog"), SIZES,
                                               ("1e-3", "3e-3")):
        args = ["--feature-map", fm, "--lr", lr, "--positions", "none" if pos == "decay" else pos]
        args += ["--decay", DECAYS] if pos == "decay" else []
        for name, value in SIZES[size].items():
            args += ["--" + name.replace("_", "-"), str(value)]
        grid[f"{fm}-{pos}-{size}-lr{lr}"] = args
    return grid


# What ``verdict`` and the report read of a setting's summary (``summarise`` writes them all).
SUMMARY_FIELDS = ("model", "seeds", "steps", "eval_steps", "lr", "arms")
ARM_FIELDS = ("steps", "reached", "final_ctx_acc", "finite", "min_denominator")
REDO = "delete it to rerun that setting (bias_training resumes from its checkpoint in that folder)"


def load_summary(path: Path) -> dict:
    """A setting's ``summary.json``; a ``DataError`` naming the file, what it lacks and the fix when it
    is not one (bad JSON, e.g. cut short; not an object; a field, the baseline or an arm's threshold
    missing), never a JSON or KeyError traceback."""
    summary = reporting.read_json(path, what="a bias_grid setting's summary", fix=REDO)
    lacks = _lacks(summary)
    if lacks:
        raise DataError(f"{path}: an incomplete summary, without {', '.join(lacks)}; {REDO}")
    return summary


def _lacks(summary: dict) -> list:
    """The fields ``summary`` should have and has not (as ``arms.bias.steps.0.9``); [] when complete."""
    lacks = [f for f in SUMMARY_FIELDS if f not in summary]
    if lacks:
        return lacks
    if not (isinstance(summary["seeds"], list) and all(type(x) is int for x in summary["seeds"])
            and type(summary["steps"]) is int):
        return ["an int steps and a list of int seeds"]
    arms = summary["arms"]
    if not isinstance(arms, dict) or not isinstance(arms.get("baseline"), dict):
        return ["arms.baseline"]
    for arm, fields in arms.items():
        if not isinstance(fields, dict):
            return [f"arms.{arm} as an object"]
        lacks += [f"arms.{arm}.{f}" for f in ARM_FIELDS if f not in fields]
        lacks += [f"arms.{arm}.{f}.{t}" for f in ("steps", "reached") if f in fields
                  for t in THRESHOLDS if not isinstance(fields[f], dict) or t not in fields[f]]
    return lacks


def read_summary(folder: Path, steps: int, seeds: list) -> dict:
    """The summary in ``folder`` (checked by ``load_summary``); a ``LiniclError`` if it was trained for
    other steps or seeds than asked, so one OUT never mixes runs of different lengths. Seeds are a set:
    the same seeds in another order are the same run (each seed's numbers are its own)."""
    summary = load_summary(folder / "summary.json")
    if summary["steps"] != steps or sorted(summary["seeds"]) != sorted(seeds):
        raise LiniclError(f"{folder}: finished with steps {summary['steps']} and seeds {summary['seeds']}, but "
                          f"--steps {steps} and --seeds {seeds} were asked; use another --out")
    return summary


def run_setting(key: str, args: list, out: Path, common: list) -> None:
    """Run one setting (resuming its checkpoint) unless its summary exists, and write its summary."""
    folder = out / key
    if (folder / "summary.json").exists():
        return
    reporting.run_logged([sys.executable, str(SCRIPT), *args, *common, "--no-progress", "--out", str(folder)], folder)
    reporting.write_json(folder / "summary.json", summarise(json.loads((folder / "bias_training.json").read_text())))


def summarise(report: dict) -> dict:
    """What the verdict needs of one setting: per arm and seed, steps to each threshold (censored at
    steps + eval_every), whether it got there, the final in-context accuracy and the accuracy curve."""
    cfg = report["config"]
    never = cfg["steps"] + cfg["eval_every"]
    arms = {}
    for arm, r in report["arms"].items():
        reached = {t: r["steps_to_ctx_acc"][t]["per_seed"] for t in THRESHOLDS}
        arms[arm] = dict(
            steps={t: [never if s is None else s for s in v] for t, v in reached.items()},
            reached={t: [s is not None for s in v] for t, v in reached.items()},
            final_ctx_acc=[r["eval"]["ctx_acc"][str(s)][-1] for s in cfg["seeds"]],
            ctx_acc_curve=r["eval"]["ctx_acc"], finite=r["finite"],
            min_denominator=r["denominators"]["min_train"])
    return dict(model=cfg["model"], seeds=cfg["seeds"], steps=cfg["steps"], eval_steps=report["arms"]["baseline"]
                ["eval_steps"], lr=cfg["lr"], arms=arms)


def verdict(summary: dict) -> dict:
    """Per bias arm: paired differences to the baseline (steps to each threshold, final accuracy)."""
    base = summary["arms"]["baseline"]
    out = {}
    for arm in BIAS_ARMS:
        if arm not in summary["arms"]:
            continue
        a = summary["arms"][arm]
        row = {}
        for t in THRESHOLDS:
            d = paired_t(a["steps"][t], base["steps"][t])
            row[f"steps_{t}"] = dict(diff=d._asdict(), sooner=d.high < 0, later=d.low > 0,
                                     reached=sum(a["reached"][t]), baseline_reached=sum(base["reached"][t]))
        d = paired_t(a["final_ctx_acc"], base["final_ctx_acc"])
        row["final_ctx_acc"] = dict(diff=d._asdict(), higher=d.low > 0, lower=d.high < 0)
        row["diverged"] = not a["finite"] or a["min_denominator"] <= 0
        out[arm] = row
    return out


def verdict_words(v: dict) -> list:
    """The significant differences of one arm in one setting, in the caption's two claims: speed (to 90 %
    and to 50 %) and final in-context accuracy; ``["no difference"]`` when none is significant."""
    words = [f"{word} to {int(100 * float(t))} %" for t in ("0.9", "0.5") for word in ("sooner", "later")
             if v[f"steps_{t}"][word]]
    words += [f"{word} final acc" for word in ("higher", "lower") if v["final_ctx_acc"][word]]
    return words or ["no difference"]


def table(results: dict) -> str:
    """One row per setting and bias arm: Δ steps to 90 % and 50 % and Δ final accuracy, with intervals."""
    header = ["setting", "arm", "Δ steps to 90 % [95 % CI]", "reached 90 % (arm/base)", "Δ steps to 50 %",
              "Δ final ctx acc (points)", "verdict"]
    rows = []
    for key, r in results.items():
        for arm, v in r["verdict"].items():
            s9, s5, fa = v["steps_0.9"], v["steps_0.5"], v["final_ctx_acc"]
            fmt = lambda d, k=1.0, p=0: f"{k * d['value']:+.{p}f} [{k * d['low']:+.{p}f}, {k * d['high']:+.{p}f}]"  # noqa: E731
            word = ", ".join(verdict_words(v)) + (", diverged" if v["diverged"] else "")
            n = len(r["summary"]["seeds"])
            rows.append([key, arm, fmt(s9["diff"]), f"{s9['reached']}/{n} vs {s9['baseline_reached']}/{n}",
                         fmt(s5["diff"]), fmt(fa["diff"], 100, 1), word])
    return reporting.markdown_table(header, rows)


def overall(results: dict) -> dict:
    """Per bias arm, the settings where it is significantly sooner / later to 90 % (and to 50 %:
    ``sooner_50``, ``later_50``) and significantly higher / lower in final in-context accuracy (the
    caption's two claims), and the settings where the
    baseline never reached 90 % on any seed (there "no difference" in speed says nothing)."""
    count = {arm: dict(sooner=[], later=[], sooner_50=[], later_50=[], higher=[], lower=[]) for arm in BIAS_ARMS}
    for key, r in results.items():
        for arm, v in r["verdict"].items():
            for word in ("sooner", "later"):
                if v["steps_0.9"][word]:
                    count[arm][word].append(key)
                if v["steps_0.5"][word]:
                    count[arm][f"{word}_50"].append(key)
            for word in ("higher", "lower"):
                if v["final_ctx_acc"][word]:
                    count[arm][word].append(key)
    unlearned = [k for k, r in results.items() if not any(r["summary"]["arms"]["baseline"]["reached"]["0.9"])]
    return dict(settings=len(results), per_arm=count, baseline_never_reached_90=unlearned)


def figure(plt, report: dict):
    """Mean Δ steps to 90 % (arm − baseline) per setting and bias arm, with the t intervals."""
    keys = list(report["results"])
    fig, ax = plt.subplots(figsize=(10, 0.32 * len(keys) * len(BIAS_ARMS) + 1.5))
    y = 0
    colors = dict(bias="tab:red", bias_nonneg="tab:green", bias_B_only="tab:purple", bias_warm="tab:orange")
    ticks = []
    for key in keys:
        for arm, v in report["results"][key]["verdict"].items():
            d = v["steps_0.9"]["diff"]
            ax.errorbar(d["value"], y, xerr=[[d["value"] - d["low"]], [d["high"] - d["value"]]], fmt="o",
                        color=colors[arm], label=arm if y < len(BIAS_ARMS) else None)
            ticks.append(f"{key} {arm}")
            y += 1
    ax.axvline(0, color="k", lw=0.8)
    ax.set_yticks(range(len(ticks)), ticks, fontsize=6)
    ax.invert_yaxis()
    ax.set(xlabel="steps to 90 % in-context accuracy, arm − baseline (paired over seeds; < 0: sooner)")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    return fig


def train_steps(quick: bool, steps, error) -> int:
    """The steps every setting trains: ``steps`` (``--steps``; None: bias_training's default, 20 with
    ``quick``), which must be a multiple of bias_training's evaluation interval (``error(message)``
    otherwise, e.g. the parser's, before anything trains)."""
    base = QUICK if quick else FULL
    steps = base["steps"] if steps is None else steps
    if steps % base["eval_every"]:
        error(f"--steps must be a multiple of {base['eval_every']} (bias_training evaluates every "
              f"{base['eval_every']} steps{' with --quick' if quick else ''}), got {steps}")
    return steps


def main(argv=None) -> int:
    p = reporting.argument_parser(__doc__)
    reporting.add_common_args(p, out="results/bias_grid", quick="2 tiny settings (CI)")
    p.add_argument("--steps", type=positive_int, default=None,
                   help=f"training steps per setting, a multiple of the evaluation interval (default {FULL['steps']}, "
                        f"every {FULL['eval_every']}; with --quick {QUICK['steps']}, every {QUICK['eval_every']})")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds (>= 2, for paired intervals)")
    p.add_argument("--only", nargs="+", default=None,
                   help="run only these settings (keys as in the JSON); other processes may run the rest into "
                        "the same OUT, and the grid's report waits for all of them")
    p.add_argument("--settings", nargs="+", default=None,
                   help="make the grid these settings only (e.g. a longer --steps run of a few of them, into "
                        "its own OUT): its report is complete when they are done")
    args = p.parse_args(argv)
    if len(set(args.seeds)) < 2 or len(set(args.seeds)) != len(args.seeds):
        p.error("--seeds: at least 2 different seeds (the verdict pairs them)")
    grid = settings(args.quick)

    def known(flag, keys):
        unknown = sorted(set(keys or []) - set(grid))
        if unknown:
            p.error(f"{flag}: unknown settings {unknown}; the grid has {sorted(grid)}")

    known("--settings", args.settings)
    if args.settings:
        grid = {k: v for k, v in grid.items() if k in args.settings}
    known("--only", args.only)
    steps = train_steps(args.quick, args.steps, p.error)
    seeds = sorted(args.seeds)  # a set: every process sharing OUT passes them to bias_training alike
    common = ["--seeds", *map(str, seeds), "--steps", str(steps)]
    out = Path(args.out)

    def summary_of(key):
        try:
            return read_summary(out / key, steps, seeds)
        except LiniclError as e:
            p.error(str(e))

    for key in grid:  # before any training: a finished setting of another length fails now, not in hours
        if (out / key / "summary.json").exists():
            summary_of(key)
    for key in tqdm([k for k in grid if k in (args.only or grid)], desc="settings", disable=not args.progress):
        run_setting(key, grid[key], out, common)
    # Every finished setting in OUT is reported (--only runs in other processes may have added some);
    # the grid's report is bias_grid.json only once every setting is done, else bias_grid_partial.json,
    # so that a partial grid is never read as the finished one (experiments/results.py looks for it).
    done = [k for k in grid if (out / k / "summary.json").exists()]
    results = {}
    for key in done:
        summary = summary_of(key)
        results[key] = dict(args=grid[key], summary=summary, verdict=verdict(summary))
    complete = len(done) == len(grid)
    name = "bias_grid" if complete else "bias_grid_partial"
    report = dict(grid=list(grid), seeds=seeds, steps=steps, quick=args.quick, complete=complete,
                  results=results, overall=overall(results), table=table(results), machine=reporting.machine_info())
    reporting.write_json(out / f"{name}.json", report)
    reporting.plot(out / f"{name}.png", figure, report)
    if not complete:
        print(f"partial grid: {len(done)} of {len(grid)} settings done; wrote {out / name}.json")
    print(report["table"])
    o = report["overall"]
    for arm, c in o["per_arm"].items():
        print(f"{arm}: of {o['settings']} settings, significantly sooner to 90 % in {len(c['sooner'])}, later in "
              f"{len(c['later'])}; to 50 % sooner in {len(c['sooner_50'])}, later in {len(c['later_50'])}; final "
              f"in-context accuracy significantly higher in {len(c['higher'])}, lower in {len(c['lower'])}")
    print(f"the baseline never reached 90 % in {len(o['baseline_never_reached_90'])} settings")
    return 0


if __name__ == "__main__":
    sys.exit(main())
