"""Dherin et al. (arXiv 2507.16003) single-block setting: context as a rank-1 update, read as implicit GD.

Setting (an unverified reconstruction; the paper's figure values are unknown, see
shared/research/implicit_updates.md §5.2): in-context linear regression with d_x = 2 and 100 context
pairs; one plain contextual block T_W = M_W ∘ A (``norm="none", skip="none"``: out = MLP(A(x)), no
skip, no norm, no positions), causal softmax attention with 8 heads of dimension 4, an MLP of width
128; trained with Adam (1e-3, 2000 steps, 64 fresh tasks per step) on the last token's label
coordinate. The zoo ties the head dimension to d_model / heads, so tokens [x; y] are zero-padded to
d_model = 32 (the public replication projects 3 -> 8 x 4 -> 3 instead).

On held-out tasks, with the query x fixed and the context read one pair at a time (C_0 = ∅ ... C_n):

1. the loss of T_W(C_i, x) and of T_{W + ΔW(C_i)}(x) against the context length i (identical), and
   the largest difference between the two predictions;
2. the implicit-GD steps ‖ΔW(C_i) - ΔW(C_{i-1})‖_F (learning rate 1/‖A(x)‖²) against i;
3. explicit finetuning of W alone (plain GD on the first n pairs, each fed as a query without
   context) against the implicit ΔW(C_n): the query loss without context, with context, and with the
   finetuned W; and the cosine between ΔW_ft and ΔW(C_n) (and between ΔW(C_n) and the first GD
   step's direction).

Writes ``OUT/implicit_dherin_<dtype>.json`` and ``OUT/implicit_dherin_<dtype>.png``.
"""

from __future__ import annotations

import functools
import os
import resource
import sys
import time

from linicl.compiled import enable_persistent_cache
from linicl import reporting
from linicl.reporting import positive_float, positive_int, positive_int_list
from linicl.timing import FAST_COMPILE, QUICK_COMPILE, peak_rss_mb


def parse(argv=None):
    p = reporting.argument_parser(__doc__)
    reporting.add_common_args(p, out="results/implicit", quick="a tiny run (CI)", seed="initialisation and tasks",
                              plots=True)
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--steps", type=positive_int, default=2000)
    p.add_argument("--batch", type=positive_int, default=64)
    p.add_argument("--lr", type=positive_float, default=1e-3)
    p.add_argument("--n-context", type=positive_int, default=100, help="context pairs before the query")
    p.add_argument("--d-x", type=positive_int, default=2)
    p.add_argument("--d-model", type=positive_int, default=32, help="tokens [x; y] zero-padded to this width")
    p.add_argument("--heads", type=positive_int, default=8)
    p.add_argument("--d-ff", type=positive_int, default=128)
    p.add_argument("--test-tasks", type=positive_int, default=256)
    p.add_argument("--ft-lengths", type=positive_int_list, default="5,10,25,50,100",
                   help="context lengths n for the finetuning comparison (those past --n-context are skipped)")
    p.add_argument("--ft-tasks", type=positive_int, default=64)
    p.add_argument("--ft-steps", type=positive_int, default=100, help="GD steps on W")
    p.add_argument("--ft-lr", type=positive_float, default=0.05)
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.batch, args.n_context, args.d_ff = 20, 16, 12, 32
        args.test_tasks, args.ft_tasks, args.ft_steps, args.ft_lengths = 8, 4, 10, [12]
    lengths = args.ft_lengths
    args.ft_lengths = sorted({n for n in lengths if n <= args.n_context})
    if not args.ft_lengths:
        p.error(f"argument --ft-lengths: no length {lengths} fits --n-context {args.n_context}")
    return args


def run(args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from tqdm.auto import tqdm

    import linicl
    from linicl import implicit
    from linicl.data import regression

    cfg = linicl.ModelConfig(vocab_size=1, d_model=args.d_model, n_layers=1, n_heads=args.heads, d_ff=args.d_ff,
                             max_len=args.n_context + 1, attention="softmax", positions="none", norm="none",
                             skip="none", final_norm=False, activation="gelu_tanh", use_bias=True,
                             dtype=args.dtype)
    model = linicl.Transformer(cfg)
    dt, d_x, N = cfg.jnp_dtype, args.d_x, args.n_context + 1
    tasks = functools.partial(regression.sample, n_tokens=N, d_x=d_x, d_model=cfg.d_model, dtype=dt)
    opt = optax.adam(args.lr)

    def loss_fn(params, batch):
        out = model.apply({"params": params}, embeds=batch.tokens, hidden=True)
        return regression.loss(regression.readout(out, d_x), batch.target)

    @functools.partial(jax.jit, compiler_options=FAST_COMPILE if args.quick else QUICK_COMPILE)
    def train_step(params, opt_state, key):
        value, grads = jax.value_and_grad(loss_fn)(params, tasks(key, args.batch))
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    t0 = time.perf_counter()
    params = regression.numpy_init(model, jnp.zeros((1, N, cfg.d_model), dt), args.seed)["params"]
    opt_state = opt.init(params)
    k_train, k_test = jax.random.split(jax.random.PRNGKey(args.seed))
    train_loss = []
    for t in tqdm(range(args.steps), desc="train the block", disable=not args.progress):
        params, opt_state, value = train_step(params, opt_state, jax.random.fold_in(k_train, t))
        train_loss.append(float(value))
    train_s = time.perf_counter() - t0
    bp = params["layers_0"]  # the block; its input is the token sequence itself (no positions)

    # 1 and 2: the trajectory over the context, for every held-out task.
    @functools.partial(jax.jit, compiler_options=FAST_COMPILE)
    def trajectories(Z):
        def one(z):
            tr = implicit.trajectory(cfg, bp, z, chunk=26)
            implied = implicit.implied(cfg, bp, tr.update, z[-1:])
            return tr.out[:, d_x], implied[:, d_x], tr.step_norms, tr.lr, implicit.frobenius(tr.update)
        return jax.lax.map(one, Z, batch_size=4)

    test = tasks(k_test, args.test_tasks)
    ctx_pred, dw_pred, steps, lrs, cum = trajectories(test.tokens)
    y = test.target[:, None]
    loss_ctx = 0.5 * jnp.mean(jnp.square(ctx_pred - y), axis=0)
    loss_dw = 0.5 * jnp.mean(jnp.square(dw_pred - y), axis=0)

    # 3: finetuning W on the first n pairs (each as a query alone) vs the implicit ΔW(C_n).
    W0 = bp["mlp"]["fc_in"]["kernel"]                                         # Wᵀ, [d, h]

    def alone_pred(kernel, x):
        p = {**bp, "mlp": {**bp["mlp"], "fc_in": {**bp["mlp"]["fc_in"], "kernel": kernel}}}
        return implicit.alone(cfg, p, x)["hook_resid_post"][..., d_x]

    @functools.partial(jax.jit, static_argnums=1, compiler_options=FAST_COMPILE)
    def finetune(batch, n):
        def one(tokens, target):
            x = tokens[:n].at[:, d_x].set(0)                              # the pairs as queries [x_j; 0]
            y_ex = tokens[:n, d_x]
            ft_loss = lambda k: 0.5 * jnp.mean(jnp.square(alone_pred(k, x) - y_ex))  # noqa: E731
            first = -jax.grad(ft_loss)(W0)
            kernel = jax.lax.fori_loop(0, args.ft_steps, lambda _, k: k - args.ft_lr * jax.grad(ft_loss)(k), W0)
            seq = jnp.concatenate([tokens[:n], tokens[-1:]])              # [C_n; query]
            upd = implicit.update(cfg, bp, implicit.pieces(cfg, bp, seq)).at(n)
            dW = upd.v[:, None] * upd.u["fc_in"][None, :]                   # ΔW(C_n)ᵀ, [d, h]
            d_ft = kernel - W0
            cos = lambda a, b: jnp.sum(a * b) / (jnp.linalg.norm(a) * jnp.linalg.norm(b))  # noqa: E731
            q = tokens[-1]
            return dict(no_context=alone_pred(W0, q), with_context=alone_pred(W0 + dW, q),
                        finetuned=alone_pred(kernel, q), ft_train_loss=ft_loss(kernel),
                        ft_train_loss_before=ft_loss(W0), cos_ft_implicit=cos(d_ft, dW),
                        cos_first_step_implicit=cos(first, dW), norm_ft=jnp.linalg.norm(d_ft),
                        norm_implicit=jnp.linalg.norm(dW))
        return jax.vmap(one)(batch.tokens, batch.target)

    ft_batch = jax.tree.map(lambda a: a[:args.ft_tasks], test)
    finetuning = []
    for n in tqdm(args.ft_lengths, desc="finetune W", disable=not args.progress):
        r = finetune(ft_batch, n)
        loss = lambda pred: float(0.5 * jnp.mean(jnp.square(pred - ft_batch.target)))  # noqa: E731
        finetuning.append(dict(
            n=n, loss_no_context=loss(r["no_context"]), loss_implicit=loss(r["with_context"]),
            loss_in_context=loss(ctx_pred[:args.ft_tasks, n]), loss_finetuned=loss(r["finetuned"]),
            ft_train_loss_before=float(jnp.mean(r["ft_train_loss_before"])),
            ft_train_loss_after=float(jnp.mean(r["ft_train_loss"])),
            cos_ft_implicit_mean=float(jnp.mean(r["cos_ft_implicit"])),
            cos_ft_implicit_abs_mean=float(jnp.mean(jnp.abs(r["cos_ft_implicit"]))),
            cos_first_step_implicit_mean=float(jnp.mean(r["cos_first_step_implicit"])),
            norm_ft_mean=float(jnp.mean(r["norm_ft"])), norm_implicit_mean=float(jnp.mean(r["norm_implicit"]))))

    tolist = lambda a: np.asarray(a).tolist()  # noqa: E731
    steps = np.asarray(steps)
    return dict(
        config=dict(vars(args), model=cfg.describe()), train_loss=train_loss, train_s=train_s,
        context_length=list(range(N)), loss_with_context=tolist(loss_ctx), loss_with_delta_W=tolist(loss_dw),
        max_abs_pred_diff=float(jnp.max(jnp.abs(ctx_pred - dw_pred))),
        pred_scale=float(jnp.max(jnp.abs(ctx_pred))),
        step_norm_mean=tolist(steps.mean(0)), step_norm_median=tolist(np.median(steps, 0)),
        step_norm_q10=tolist(np.quantile(steps, 0.1, axis=0)), step_norm_q90=tolist(np.quantile(steps, 0.9, axis=0)),
        delta_W_norm_mean=tolist(np.asarray(cum).mean(0)),
        learning_rate_median=float(np.median(lrs)), learning_rate_min=float(np.min(lrs)),
        learning_rate_max=float(np.max(lrs)), finetuning=finetuning)


def figure(plt, report: dict):
    """Loss against context length, implicit GD step norms, and implicit against explicit updates."""
    import numpy as np

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4))
    n = np.asarray(report["context_length"])
    a.plot(n, report["loss_with_context"], "-", lw=3, alpha=0.5, label="T_W(C_i, x): with context")
    a.plot(n, report["loss_with_delta_W"], "--", label="T_{W+ΔW(C_i)}(x): no context, updated W")
    a.axhline(report["loss_with_context"][0], color="grey", ls=":", label="T_W(x): no context, no update")
    a.set(xlabel="context pairs i", ylabel="held-out loss", yscale="log", title="context = rank-1 update of W")
    a.legend(fontsize=8)
    i = n[1:]
    b.plot(i, report["step_norm_median"], label="median over tasks")
    b.fill_between(i, report["step_norm_q10"], report["step_norm_q90"], alpha=0.3, label="10-90 %")
    b.set(xlabel="context pair i", ylabel="‖ΔW(C_i) - ΔW(C_{i-1})‖_F", yscale="log", xscale="log",
          title="implicit GD steps shrink")
    b.legend(fontsize=8)
    ft = report["finetuning"]
    m = [r["n"] for r in ft]
    c.plot(m, [r["loss_no_context"] for r in ft], "o:", label="no context")
    c.plot(m, [r["loss_implicit"] for r in ft], "s-", label="ΔW(C_n) (= in context)")
    c.plot(m, [r["loss_finetuned"] for r in ft], "^-", label="W finetuned on the n pairs")
    c.set(xlabel="context pairs n", ylabel="query loss", xscale="log", title="implicit vs explicit update")
    c2 = c.twinx()
    c2.plot(m, [r["cos_ft_implicit_mean"] for r in ft], "k--", label="cos(ΔW_ft, ΔW(C_n))")
    c2.set(ylabel="cosine", ylim=(-1, 1))
    c.set_ylim(0, None)
    c.legend(fontsize=8, loc="center left")
    c2.legend(fontsize=8, loc="center right")
    fig.tight_layout()
    return fig


def main(argv=None) -> int:
    enable_persistent_cache()  # executables kept on disk across runs (LINICL_COMPILATION_CACHE)
    start = time.perf_counter()
    args = parse(argv)
    import jax
    if args.dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    report = run(args)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    report.update(wall_s=time.perf_counter() - start, cpu_s=usage.ru_utime + usage.ru_stime,
                  peak_rss_mb=peak_rss_mb(), machine=reporting.machine_info())
    prefix = os.path.join(args.out, f"implicit_dherin_{args.dtype}")
    reporting.write_json(prefix + ".json", report, indent=None)
    lc, ld = report["loss_with_context"], report["loss_with_delta_W"]
    print(f"{report['config']['model']}: trained {args.steps} steps in {report['train_s']:.1f} s "
          f"(final train loss {report['train_loss'][-1]:.4f})")
    print(f"held-out loss, no context {lc[0]:.4f}; with all {len(lc) - 1} pairs {lc[-1]:.4f} (with ΔW: {ld[-1]:.4f}); "
          f"largest prediction gap {report['max_abs_pred_diff']:.1e} (scale {report['pred_scale']:.1f})")
    s = report["step_norm_median"]
    print("median step norm at i = " + ", ".join(f"{i}: {s[i - 1]:.2e}" for i in sorted({1, 2, 5, 10, 50, len(s)}) if i <= len(s))
          + f"; learning rate 1/‖A(x)‖² median {report['learning_rate_median']:.3g}")
    for r in report["finetuning"]:
        print(f"n={r['n']:4d}: loss no-context {r['loss_no_context']:.4f}, implicit {r['loss_implicit']:.4f}, "
              f"finetuned {r['loss_finetuned']:.4f}; cos(ΔW_ft, ΔW) {r['cos_ft_implicit_mean']:+.3f}, "
              f"cos(first GD step, ΔW) {r['cos_first_step_implicit_mean']:+.3f}")
    png = args.plots and reporting.plot(prefix + ".png", figure, report)
    print(f"wrote {prefix}.json" + (" and .png" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
