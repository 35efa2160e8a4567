"""check_token_ids: the one check of token-id prompts (the server's and the engine's). Plain int
lists take a fast path; every other input and every bad id must be refused as before."""

import re

import numpy as np
import pytest

from paxengine.errors import InvalidRequest
from paxengine.validation import check_token_ids


@pytest.mark.parametrize(
    "ids", [[], [0], list(range(100)), (3, 4, 99), [np.int32(5), 7], np.arange(10)]
)
def test_valid_ids_pass(ids):
    check_token_ids(ids, 100)


@pytest.mark.parametrize(
    "ids,bad",
    [
        ([1, 2, 100], "100"),
        ([1, -1, 2], "-1"),
        ([1, True, 2], "True"),
        ([1, 2.0], "2.0"),
        ([1, "7"], "'7'"),
        ((5, 100), "100"),
        ([np.int64(100)], re.escape(repr(np.int64(100)))),
    ],
)
def test_bad_ids_are_named(ids, bad):
    with pytest.raises(InvalidRequest, match=f"token id {bad} is outside the vocabulary") as e:
        check_token_ids(ids, 100, "prompt")
    assert e.value.param == "prompt"


def test_truncate_prompt_keeps_the_last_tokens():
    from paxengine.sampling_params import SamplingParams
    from paxengine.validation import truncate_prompt

    ids = list(range(10))
    assert truncate_prompt("t", ids, None, 8) == ("t", ids)  # unset: untouched
    assert truncate_prompt("t", ids, 4, 16) == (None, [6, 7, 8, 9])  # cut: no text
    assert truncate_prompt("t", ids, 10, 16) == ("t", ids)  # nothing cut: text kept
    assert truncate_prompt("t", ids, -1, 7) == (None, ids[-7:])  # -1: max_model_len
    for k, why in ((0, "must be -1 or an integer >= 1"), (-2, "must be"), (9, "exceeds")):
        with pytest.raises(InvalidRequest, match=why) as e:
            truncate_prompt("t", ids, k, 8)
        assert e.value.param == "truncate_prompt_tokens"
    with pytest.raises(InvalidRequest, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=True).validate(100)
