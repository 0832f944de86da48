"""ICL data: tasks read from a data directory (``datasets``) and tokenized prompts with a per-token role
mask (``prompts``). The data directory is ``data_dir=`` or the environment variable ``LINICL_DATA_DIR``.
"""

from linicl.data.datasets import (AGNEWS_LABEL_WORDS, CB_LABEL_WORDS, CB_LABEL_WORDS_ABC, LABEL_WORDS,
                                  SST2_LABEL_WORDS, TREC_LABEL_WORDS, TREC_LABEL_WORDS_PAPER, DataError,
                                  Example, Task, list_tasks, load_task, resolve_data_dir)
from linicl.data.prompts import (BOS, DEMO_INPUT, DEMO_LABEL, INSTRUCTION, PAD, QUERY, SEPARATOR, TEMPLATES,
                                 Prompt, PromptBatch, Role, Template, TextEncoder, batch_prompts,
                                 build_eval_set, build_prompt, check_label_words, sample_demos, template_for,
                                 tokenization_mismatch)

__all__ = ["DataError", "Example", "Task", "list_tasks", "load_task", "resolve_data_dir", "LABEL_WORDS",
           "SST2_LABEL_WORDS", "TREC_LABEL_WORDS", "TREC_LABEL_WORDS_PAPER", "AGNEWS_LABEL_WORDS",
           "CB_LABEL_WORDS", "CB_LABEL_WORDS_ABC",
           "Role", "PAD", "BOS", "INSTRUCTION", "SEPARATOR", "DEMO_INPUT", "DEMO_LABEL", "QUERY",
           "Template", "TEMPLATES", "template_for", "TextEncoder", "Prompt", "PromptBatch", "sample_demos",
           "build_prompt", "tokenization_mismatch", "check_label_words", "batch_prompts",
           "build_eval_set"]
