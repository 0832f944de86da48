"""Speed benchmarks of linicl against peers measured in the same run: a PyTorch reference on the same
weights, the matmul chain of the same products, and a cold against a warm compilation cache.

Timings on a shared machine drift, so nothing here is compared with a number from another run: each
ratio divides two measurements taken side by side (alternating rounds, medians). Modules, one concept
each:

* ``torch_reference``: the PyTorch side (``TorchSide``: HF ``transformers`` causal LMs by name, their
  logits, forward and decode timings), in this process or in a worker process of another interpreter
  (``TorchWorker``; the file imports neither jax nor linicl, so a torch-only Python runs it);
  ``open_torch`` picks one. ``random_tokens``: the ids both sides read. torch and transformers are
  optional: imported only when a ``TorchSide`` is made.
* ``side_by_side``: ``timed_rounds``, forward tokens/s per ``(batch, seq)`` of linicl, its matmul peer
  (``linicl.timing.matmul_peer``) and each PyTorch variant, and ``summarise_rounds``, their medians
  and ratios (``format_rounds``, ``plot_rounds``: as a table, as bars); ``compare_logits`` and
  ``torch_twin`` (a linicl model exported by ``linicl.lm.save_pretrained`` and loaded by HF);
  ``decode_speed`` / ``torch_decode_speed``, greedy decoding with the KV cache;
  ``fresh_process_load_times``, a pretrained checkpoint's load in fresh processes.
* ``compile_times``: each call's first run against its second, split by ``linicl.timing.CompileMeter``
  (``forward_compile_times``, ``generate_compile_times``), and the ratios between two processes'
  measurements (``warm_over_cold``, ``scan_over_loop``).
* ``random_models``: random-weight models at the benchmarks' shapes (``GPT2_SMALL``, ``GPT2_TINY``,
  ``write_random_gpt2``: an HF GPT-2 checkpoint drawn with NumPy; ``tiny_softmax_lm``).

``experiments/benchmarks/lm_speed.py`` and ``compile_speed.py`` run them.
"""

from linicl.benchmarking.compile_times import (counting_prompt, forward_compile_times, generate_compile_times,
                                               scan_over_loop, warm_over_cold)
from linicl.benchmarking.random_models import GPT2_SMALL, GPT2_TINY, tiny_softmax_lm, write_random_gpt2
from linicl.benchmarking.side_by_side import (compare_logits, decode_speed, format_rounds, fresh_process_load_times,
                                              plot_rounds, summarise_rounds, timed_rounds, torch_decode_speed,
                                              torch_twin, torch_variants, variant_columns, variant_status)
from linicl.benchmarking.torch_reference import TorchSide, TorchWorker, open_torch, random_tokens, serve

__all__ = ["TorchSide", "TorchWorker", "open_torch", "serve", "random_tokens", "compare_logits", "torch_variants",
           "torch_twin", "variant_status", "timed_rounds", "summarise_rounds", "variant_columns", "format_rounds",
           "plot_rounds", "decode_speed", "torch_decode_speed", "fresh_process_load_times", "counting_prompt",
           "forward_compile_times", "generate_compile_times", "warm_over_cold", "scan_over_loop", "GPT2_SMALL",
           "GPT2_TINY", "write_random_gpt2", "tiny_softmax_lm"]
