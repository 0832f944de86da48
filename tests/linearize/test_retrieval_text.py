"""linearize.retrieval_sequences: long training text that ends in a recall (passkey or key-value
prompt followed by its answer), from the training split's filler only."""

import numpy as np
import pytest

from linicl import linearize
from linicl.data import long_context as lc
from linicl.errors import LiniclError
from helpers import CharTokenizer


Chars = CharTokenizer


@pytest.mark.usefixtures("data_env")
def test_sequences_end_in_the_answer_to_their_question():
    tok = Chars()
    rows = linearize.retrieval_sequences(tok, n=4, length=900, seed=1)
    assert rows.shape == (4, 900) and rows.dtype == np.int32
    for i, row in enumerate(rows):
        text = tok.decode(row[1:])
        question, answer = text.rsplit("is", 1)
        key = answer.strip()
        assert answer.endswith("\n") and len(key) == 5 and key.isdigit()
        line = "The pass key is " if i % 2 == 0 else "The code for "
        assert line in question and key in question  # the key was stated earlier in the text
        if i % 2 == 1:
            name = question.rsplit("The code for ", 1)[1].split(" ")[0]
            assert f"The code for {name} is {key}." in question
    again = linearize.retrieval_sequences(tok, n=4, length=900, seed=1)
    np.testing.assert_array_equal(rows, again)
    # The filler is the training split's: no window of a sequence comes from the test split's stream.
    test_text = tok.decode(lc.filler_stream(tok, split="test"))
    chunk = tok.decode(rows[0][200:260])
    assert chunk not in test_text


def test_bad_n_is_named():
    with pytest.raises(LiniclError, match="n >= 1"):
        linearize.retrieval_sequences(Chars(), n=0, length=100)
