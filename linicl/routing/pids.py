"""Principal ICL directions (PIDs): where few-shot prompts move the routed layers' queries and keys.

Per routed layer (the last third, ``routed_layers``), the last-token q and k projections of
class-balanced few-shot prompts, concatenated over heads and before rope, are reduced by a PCA to r
directions: ``U_q: [heads * d_head, r]``, ``U_k: [kv_heads * d_head, r]`` (r = 8 in the paper).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from linicl.config import ModelConfig
from linicl.errors import DataError, DegenerateInputError, LiniclError
from linicl.names import block_site
from linicl.nn.transformer import config_of
from linicl.activations import collect_activations

_ARRAYS = ("U_q", "U_k", "mean_q", "mean_k", "explained_q", "explained_k")


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


@dataclass(frozen=True)
class PIDs:
    """Principal ICL directions of the routed layers: ``U_q[i]: [heads * d_head, r]`` and
    ``U_k[i]: [kv_heads * d_head, r]`` for layer ``layers[i]``, with the means and explained variance
    of the PCA and free-form ``meta`` (tasks, prompt counts, model)."""

    layers: tuple
    U_q: np.ndarray
    U_k: np.ndarray
    mean_q: np.ndarray
    mean_k: np.ndarray
    explained_q: np.ndarray
    explained_k: np.ndarray
    centered: bool = True
    meta: dict = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return int(self.U_q.shape[-1])

    def save(self, path) -> Path:
        """One ``.npz`` (arrays + a JSON string of the metadata)."""
        path = Path(path).with_suffix(".npz")
        path.parent.mkdir(parents=True, exist_ok=True)
        info = json.dumps({"layers": list(self.layers), "centered": self.centered, "meta": self.meta})
        np.savez(path, **{k: getattr(self, k) for k in _ARRAYS}, info=np.asarray(info))
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
        return cls(layers=tuple(info["layers"]), centered=info["centered"], meta=info["meta"], **arrays)


def extract_pids(model, variables, prompts, *, layers: Optional[Sequence[int]] = None, r: int = 8,
                 center: bool = True, batch_size: int = 16, meta: Optional[dict] = None,
                 progress: bool = False) -> PIDs:
    """PCA of the last-token q and k projections (before rope, concatenated over heads) of
    ``prompts`` (few-shot ``linicl.data.Prompt`` objects of the in-domain tasks) at each routed layer."""
    cfg = config_of(model)
    layers = routed_layers(cfg) if layers is None else check_routable(cfg, layers)
    sites = [block_site(l, f"hook_{s}") for l in layers for s in ("q", "k")]
    acts = collect_activations(model, variables, prompts, sites, batch_size=batch_size, progress=progress)
    parts = {k: [] for k in _ARRAYS}
    for l in layers:
        for s in ("q", "k"):
            X = acts[block_site(l, f"hook_{s}")]
            U, mean, ev = pca(X.reshape(X.shape[0], -1), r, center, name=block_site(l, f"hook_{s}"))
            parts[f"U_{s}"].append(U)
            parts[f"mean_{s}"].append(mean)
            parts[f"explained_{s}"].append(ev)
    info = {"n_prompts": len(acts[sites[0]]), "model": cfg.describe(), **(meta or {})}
    return PIDs(layers=layers, centered=center, meta=info, **{k: np.stack(v) for k, v in parts.items()})
