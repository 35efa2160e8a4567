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
