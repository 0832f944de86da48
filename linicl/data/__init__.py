"""ICL data: tasks read from a data directory (``datasets``) as their spec files say (``specs``),
downloaded by ``fetch`` (``linicl data fetch``), and tokenized prompts with a per-token role mask
(``prompts``). The data directory is ``data_dir=``, else the environment variable ``LINICL_DATA_DIR``,
else the per-user cache ``default_data_dir()`` (``~/.cache/linicl/data``).
"""

from linicl.data.datasets import (AGNEWS_LABEL_WORDS, CB_LABEL_WORDS, CB_LABEL_WORDS_ABC, LABEL_WORDS,
                                  SST2_LABEL_WORDS, TREC_LABEL_WORDS, TREC_LABEL_WORDS_PAPER, DataError,
                                  Example, Task, default_data_dir, list_tasks, load_task, locate_data_dir,
                                  resolve_data_dir)
from linicl.data.prompts import (BOS, DEMO_INPUT, DEMO_LABEL, INSTRUCTION, PAD, QUERY, SEPARATOR, TEMPLATES,
                                 Prompt, PromptBatch, Role, Template, TextEncoder, batch_prompts,
                                 build_eval_set, build_prompt, check_label_words, fit_queries, sample_demos,
                                 shared_context, template_for, tokenization_mismatch, wrong_labels)
from linicl.data.specs import FileSpec, TaskSpec, all_specs, find_spec, read_spec

__all__ = ["DataError", "Example", "Task", "list_tasks", "load_task", "resolve_data_dir", "locate_data_dir",
           "default_data_dir", "LABEL_WORDS",
           "SST2_LABEL_WORDS", "TREC_LABEL_WORDS", "TREC_LABEL_WORDS_PAPER", "AGNEWS_LABEL_WORDS",
           "CB_LABEL_WORDS", "CB_LABEL_WORDS_ABC",
           "TaskSpec", "FileSpec", "find_spec", "all_specs", "read_spec",
           "Role", "PAD", "BOS", "INSTRUCTION", "SEPARATOR", "DEMO_INPUT", "DEMO_LABEL", "QUERY",
           "Template", "TEMPLATES", "template_for", "TextEncoder", "Prompt", "PromptBatch", "sample_demos", "wrong_labels",
           "build_prompt", "tokenization_mismatch", "check_label_words", "batch_prompts",
           "build_eval_set", "shared_context", "fit_queries"]
