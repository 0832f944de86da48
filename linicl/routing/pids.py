"""Principal ICL directions (PIDs): where few-shot prompts move the routed layers' queries and keys.

Per routed layer (the last third, ``routed_layers``), the last-token q and k projections of
class-balanced few-shot prompts, concatenated over heads and before rope, are reduced by a PCA to r
directions: ``U_q: [heads * d_head, r]``, ``U_k: [kv_heads * d_head, r]`` (r = 8 in the paper).

The size of the bias they make (``PIDs.bias``, ``linicl.names.BIAS_SCALES``):

* ``"paper"``: ``z_q = Q U_q``, ``z_k = K U_k``, ``B = z_q diag(alpha) z_k^T``, as the paper writes it.
  Its size follows the model's q/k norms: on SmolLM2 one direction at |alpha| = 1 moves the logits by
  13-37 (std over keys) where the model's own logits spread by 1.8-3.0 (routing.md), and a random
  basis moves them by another amount, so the two are not compared at the same bias size.
* ``"logit"`` (``on_logit_scale``): ``z_q = (Q - mean_q) U_q / sd_q``, ``z_k`` alike (centred by the
  PCA means, each direction divided by its spread over the calibration prompts), and ``B`` times
  ``bias_scale[l]``, set so that one direction at |alpha| = 1 moves layer l's logits by one standard
  deviation (over keys) of the model's own logits there. A random basis calibrated the same way has
  the same bias size as the PIDs.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import flax.struct
import numpy as np

from linicl.config import ModelConfig
from linicl.errors import DataError, DegenerateInputError, LiniclError
from linicl.names import BIAS_SCALES, block_site
from linicl.nn.transformer import config_of
from linicl.activations import collect_activations

_ARRAYS = ("U_q", "U_k", "mean_q", "mean_k", "explained_q", "explained_k")
_SCALE_ARRAYS = ("sd_q", "sd_k", "bias_scale")  # only with bias="logit"


def routed_layers(cfg: ModelConfig) -> tuple:
    """The last third of the layers, 0-based: floor(2L/3) .. L-1 (GPT-2 small: 8-11; SmolLM2: 20-29).
    Of a model with local (sliding-window) layers only the global ones (Gemma 3 270M: 17): a local
    layer runs as a finite-state window with no logits site (``hook_attn_scores``) to bias."""
    layers = tuple(l for l in range((2 * cfg.n_layers) // 3, cfg.n_layers) if l in cfg.global_layers)
    if not layers:
        raise LiniclError(f"routed_layers: the last third of this model's layers (layer_types="
                          f"{cfg.layer_types!r}) has no global layer to route; pass layers= explicitly")
    return layers


def check_routable(cfg: ModelConfig, layers: Sequence[int]) -> tuple:
    """``layers`` as a tuple, each a global softmax layer of ``cfg`` (one with ``hook_attn_scores``)."""
    layers = tuple(int(l) for l in layers)
    if cfg.attention != "softmax":
        raise LiniclError(f"routing biases softmax attention logits; this model has attention={cfg.attention!r}")
    bad = [l for l in layers if l not in cfg.global_layers]
    if not layers or bad:
        raise LiniclError(f"layers must be a non-empty sequence of this model's global layers "
                          f"{cfg.global_layers} (local sliding-window layers have no logits site), got {layers}")
    return layers


def pca(X: np.ndarray, r: int, center: bool = True, name: str = "X"):
    """Top-r principal directions of the rows of ``X: [N, d]``: ``(U [d, r] orthonormal, mean [d],
    explained variance ratio [r])``. Uncentred, the directions are those of the second moment.

    ``X`` (called ``name`` in errors) must be finite and must vary: rows that are all the same
    (centred) or all zero (uncentred) have no principal direction, and the ratio would be 0/0."""
    X = np.asarray(X, np.float64)
    if X.ndim != 2 or X.shape[0] < 2 or not 1 <= r <= min(X.shape):
        raise LiniclError(f"pca needs {name} of shape [N >= 2, d] and 1 <= r <= min(N, d); got {X.shape}, r={r}")
    if not np.all(np.isfinite(X)):
        rows = np.flatnonzero(~np.all(np.isfinite(X), axis=1))
        raise LiniclError(f"pca: {name} has non-finite values (NaN/inf) in rows {rows[:8].tolist()}"
                          f"{'...' if rows.size > 8 else ''}")
    mean = X.mean(axis=0) if center else np.zeros(X.shape[1])
    Xc = X - mean
    # Degenerate: what is left after centring is rounding of the mean (relative eps per summed row),
    # not variance; its "directions" would be noise and a constant X gives a 0/0 ratio.
    if np.linalg.norm(Xc) <= X.shape[0] * np.finfo(np.float64).eps * np.linalg.norm(X):
        how = "every row is the same" if center else "every entry is zero"
        raise DegenerateInputError(f"pca: {name} has no variance ({how}, {X.shape[0]} rows): there is no "
                                   f"principal direction")
    _, s, vt = np.linalg.svd(Xc, full_matrices=False)
    return vt[:r].T, mean, (s[:r] ** 2) / np.sum(s ** 2)


@flax.struct.dataclass
class RoutingBias:
    """What the routing bias reads of a ``PIDs`` (``PIDs.routing_bias``), as a pytree: the routed
    ``layers`` (static) and per layer the arrays of ``PIDs.bias_params``. Passed as an argument of a
    jitted function, it lets one compilation serve every basis of the same shapes (PIDs, a random
    basis, either bias scale)."""
    layers: tuple = flax.struct.field(pytree_node=False)
    params: tuple = ()


@dataclass(frozen=True)
class PIDs:
    """Principal ICL directions of the routed layers: ``U_q[i]: [heads * d_head, r]`` and
    ``U_k[i]: [kv_heads * d_head, r]`` for layer ``layers[i]``, with the means and explained variance
    of the PCA and free-form ``meta`` (tasks, prompt counts, model).

    ``bias`` (module docstring): ``"paper"``, or ``"logit"`` with ``sd_q, sd_k: [n_layers, r]`` (the
    spread of each direction's projection) and ``bias_scale: [n_layers]``."""

    layers: tuple
    U_q: np.ndarray
    U_k: np.ndarray
    mean_q: np.ndarray
    mean_k: np.ndarray
    explained_q: np.ndarray
    explained_k: np.ndarray
    centered: bool = True
    meta: dict = field(default_factory=dict)
    bias: str = "paper"
    sd_q: Optional[np.ndarray] = None
    sd_k: Optional[np.ndarray] = None
    bias_scale: Optional[np.ndarray] = None

    def __post_init__(self):
        # plain ints (layers read back from an .npz are numpy ints): they key compiled functions and go to JSON
        object.__setattr__(self, "layers", tuple(int(l) for l in self.layers))
        if self.bias not in BIAS_SCALES:
            raise LiniclError(f"PIDs.bias must be one of {BIAS_SCALES}, got {self.bias!r}")
        given = [getattr(self, k) is not None for k in _SCALE_ARRAYS]
        if any(given) != (self.bias == "logit") or not (all(given) or not any(given)):
            raise LiniclError(f"PIDs: sd_q, sd_k and bias_scale come together and only with bias='logit' "
                              f"(use on_logit_scale); bias={self.bias!r}, given {dict(zip(_SCALE_ARRAYS, given))}")

    @property
    def rank(self) -> int:
        return int(self.U_q.shape[-1])

    def bias_params(self, i: int) -> dict:
        """What the bias of layer ``layers[i]`` needs (``router._bias``, which computes it in the
        scores' precision, float32 at least): the bases ``U_q, U_k``, the centres ``c_q, c_k``, the inverse spreads ``w_q, w_k: [r]`` and the scale ``s``;
        with ``bias="paper"`` the centres are 0 and the rest 1, so B is the paper's, bit for bit."""
        r = self.rank
        paper = self.bias == "paper"
        f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
        return {"U_q": f64(self.U_q[i]), "U_k": f64(self.U_k[i]),
                "c_q": f64(np.zeros_like(self.mean_q[i]) if paper else self.mean_q[i]),
                "c_k": f64(np.zeros_like(self.mean_k[i]) if paper else self.mean_k[i]),
                "w_q": f64(np.ones(r) if paper else 1.0 / self.sd_q[i]),
                "w_k": f64(np.ones(r) if paper else 1.0 / self.sd_k[i]),
                "s": f64(1.0 if paper else self.bias_scale[i])}

    def routing_bias(self) -> RoutingBias:
        """The bias's arrays of every routed layer (``bias_params``) as a ``RoutingBias``."""
        return RoutingBias(self.layers, tuple(self.bias_params(i) for i in range(len(self.layers))))

    def save(self, path) -> Path:
        """One ``.npz`` (arrays + a JSON string of the metadata)."""
        path = Path(path).with_suffix(".npz")
        path.parent.mkdir(parents=True, exist_ok=True)
        info = json.dumps({"layers": list(self.layers), "centered": self.centered, "meta": self.meta,
                           "bias": self.bias})
        arrays = {k: getattr(self, k) for k in _ARRAYS + _SCALE_ARRAYS if getattr(self, k) is not None}
        np.savez(path, **arrays, info=np.asarray(info))
        return path

    @classmethod
    def load(cls, path) -> "PIDs":
        path = Path(path)
        try:
            with np.load(path, allow_pickle=False) as f:
                arrays = {k: f[k] for k in f.files}
            info = json.loads(str(arrays.pop("info")))
        except (OSError, ValueError, KeyError) as e:
            raise DataError(f"{path} is not a PIDs file written by PIDs.save: {e}") from None
        return cls(layers=tuple(info["layers"]), centered=info["centered"], meta=info["meta"],
                   bias=info.get("bias", "paper"), **arrays)


def pid_activations(model, variables, prompts, *, layers: Optional[Sequence[int]] = None, batch_size: int = 16,
                    progress: bool = False) -> dict:
    """The last-token q and k projections (before rope, concatenated over heads) of ``prompts`` at each
    routed layer: ``{"layers": (l, ...), "q": [n_layers, N, heads * d_head], "k": [n_layers, N,
    kv_heads * d_head]}``. Collected in parts (e.g. per task, to resume), they are concatenated along
    N before ``fit_pids``."""
    cfg = config_of(model)
    layers = routed_layers(cfg) if layers is None else check_routable(cfg, layers)
    sites = [block_site(l, f"hook_{s}") for l in layers for s in ("q", "k")]
    acts = collect_activations(model, variables, prompts, sites, batch_size=batch_size, progress=progress)
    n = len(acts[sites[0]])
    return {"layers": layers, **{s: np.stack([acts[block_site(l, f"hook_{s}")].reshape(n, -1) for l in layers])
                                 for s in ("q", "k")}}


def fit_pids(acts: dict, *, r: int = 8, center: bool = True, meta: Optional[dict] = None) -> PIDs:
    """PCA per routed layer of ``pid_activations``'s q and k (rank ``r``)."""
    layers = tuple(acts["layers"])
    parts = {k: [] for k in _ARRAYS}
    for i, l in enumerate(layers):
        for s in ("q", "k"):
            U, mean, ev = pca(acts[s][i], r, center, name=block_site(l, f"hook_{s}"))
            parts[f"U_{s}"].append(U)
            parts[f"mean_{s}"].append(mean)
            parts[f"explained_{s}"].append(ev)
    info = {"n_prompts": int(acts["q"].shape[1]), **(meta or {})}
    return PIDs(layers=layers, centered=center, meta=info, **{k: np.stack(v) for k, v in parts.items()})


def extract_pids(model, variables, prompts, *, layers: Optional[Sequence[int]] = None, r: int = 8,
                 center: bool = True, batch_size: int = 16, meta: Optional[dict] = None,
                 progress: bool = False) -> PIDs:
    """PCA of the last-token q and k projections (before rope, concatenated over heads) of
    ``prompts`` (few-shot ``linicl.data.Prompt`` objects of the in-domain tasks) at each routed layer:
    ``fit_pids(pid_activations(...))``."""
    acts = pid_activations(model, variables, prompts, layers=layers, batch_size=batch_size, progress=progress)
    return fit_pids(acts, r=r, center=center, meta={"model": config_of(model).describe(), **(meta or {})})


def random_basis(pids: PIDs, seed: int) -> PIDs:
    """The paper's control: random orthonormal bases (Gaussian, then QR) of the shapes of ``pids``,
    with its means; a logit-scale copy goes back to the paper's bias (calibrate it again with
    ``on_logit_scale`` to compare at the same bias size)."""
    rng = np.random.default_rng(seed)

    def rand(U):
        return np.stack([np.linalg.qr(rng.normal(size=u.shape))[0] for u in U])
    return PIDs(layers=pids.layers, U_q=rand(pids.U_q), U_k=rand(pids.U_k), mean_q=pids.mean_q,
                mean_k=pids.mean_k, explained_q=np.full_like(pids.explained_q, np.nan),
                explained_k=np.full_like(pids.explained_k, np.nan), centered=pids.centered,
                meta={**pids.meta, "random_basis_seed": int(seed)})


def _masked_row_std(x, lengths):
    """Per prompt, the mean over heads and query rows 1 <= t < length of the std over the keys s <= t
    of ``x: [b, heads, T, T]`` -> ``[b]``."""
    import jax.numpy as jnp
    T = x.shape[-1]
    t, s = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
    keys = (s <= t)[None, None] & (t < lengths[:, None, None, None])  # [b, 1, T, T]
    count = jnp.maximum(jnp.sum(keys, -1), 1)
    x = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    mean = jnp.sum(jnp.where(keys, x, 0), -1) / count
    std = jnp.sqrt(jnp.sum(jnp.where(keys, (x - mean[..., None]) ** 2, 0), -1) / count)  # [b, H, T]
    rows = ((jnp.arange(T)[None, :] >= 1) & (jnp.arange(T)[None, :] < lengths[:, None]))[:, None, :]
    return jnp.sum(jnp.where(rows, std, 0), (1, 2)) / jnp.maximum(jnp.sum(rows, -1)[:, 0] * x.shape[1], 1)


def _prefix_std(z: np.ndarray) -> np.ndarray:
    """``z: [T, r]`` -> ``[T, r]``: row t holds the std of z[0..t] (population)."""
    n = np.arange(1, len(z) + 1)[:, None]
    m1, m2 = np.cumsum(z, 0) / n, np.cumsum(z * z, 0) / n
    return np.sqrt(np.maximum(m2 - m1 * m1, 0.0))


def on_logit_scale(model, variables, pids: PIDs, prompts, *, batch_size: int = 16, progress: bool = False) -> PIDs:
    """``pids`` with the bias on the model's logit scale (module docstring), calibrated on ``prompts``
    (the inputs the router will see, e.g. zero-shot queries; ``linicl.data.Prompt`` or token arrays).

    Per routed layer l and direction j, over the prompts' real positions after the first (the first
    token is the attention sink, an outlier): ``sd_q[l, j]`` is the spread of ``(q - mean_q) U_q[:, j]``
    (``sd_k`` alike). Then ``bias_scale[l] = sigma_model / sigma_B``: ``sigma_model`` the std over
    keys s <= t of the model's own logits at ``hook_attn_scores``, ``sigma_B`` that of the whitened
    one-direction bias ``z_q[t, j] z_k[s, j]``, each the mean over query rows t >= 1, heads (or
    directions) and prompts. Measured on the unrouted model; ``meta["logit_std"]`` keeps sigma_model
    per layer."""
    sites = {}
    for i, l in enumerate(pids.layers):
        for s in ("q", "k", "attn_scores"):
            sites[block_site(l, f"hook_{s}")] = (i, s)
    lengths = np.asarray([len(getattr(p, "tokens", p)) for p in prompts])
    T = int(lengths.max())
    if T < 3:
        raise DegenerateInputError(f"on_logit_scale: the prompts are at most {T} tokens long; a spread over "
                                   f"keys needs query rows with two or more keys after the first token")

    def reduce(act, name, tokens, lens):
        import jax.numpy as jnp
        i, s = sites[name]
        if s == "attn_scores":
            return _masked_row_std(act, lens)
        dt = jnp.promote_types(act.dtype, jnp.float32)
        U = jnp.asarray(pids.U_q[i] if s == "q" else pids.U_k[i]).astype(dt)
        c = jnp.asarray(pids.mean_q[i] if s == "q" else pids.mean_k[i]).astype(dt)
        z = (act.reshape(act.shape[0], act.shape[1], -1).astype(dt) - c) @ U  # [b, T', r]
        z = z[:, :T]
        return jnp.pad(z, ((0, 0), (0, T - z.shape[1]), (0, 0)))
    acts = collect_activations(model, variables, prompts, list(sites), batch_size=batch_size, reduce=reduce,
                               progress=progress)
    sd = {"q": [], "k": []}
    scale, own = [], []
    for i, l in enumerate(pids.layers):
        z = {s: acts[block_site(l, f"hook_{s}")].astype(np.float64) for s in ("q", "k")}
        for s in ("q", "k"):
            real = np.concatenate([z[s][n, 1:lengths[n]] for n in range(len(lengths))])
            spread = real.std(axis=0)
            if not np.all(spread > 0):
                raise DegenerateInputError(f"on_logit_scale: layer {l}: the {s} projection does not vary along "
                                           f"directions {np.flatnonzero(~(spread > 0)).tolist()} over the prompts")
            sd[s].append(spread)
        sigma_b = np.mean([np.mean(np.abs(z["q"][n, 1:lengths[n]] / sd["q"][-1])
                                   * _prefix_std(z["k"][n, :lengths[n]] / sd["k"][-1])[1:])
                           for n in range(len(lengths))])
        sigma_model = float(np.mean(acts[block_site(l, "hook_attn_scores")]))
        if not (np.isfinite(sigma_b) and sigma_b > 0 and np.isfinite(sigma_model) and sigma_model > 0):
            raise DegenerateInputError(f"on_logit_scale: layer {l}: logit spread {sigma_model}, bias spread "
                                       f"{sigma_b}: no scale relates them")
        scale.append(sigma_model / sigma_b)
        own.append(sigma_model)
    meta = {**pids.meta, "logit_scale_prompts": int(len(lengths)), "logit_std": own}
    return dataclasses.replace(pids, bias="logit", sd_q=np.stack(sd["q"]), sd_k=np.stack(sd["k"]),
                               bias_scale=np.asarray(scale), meta=meta)
