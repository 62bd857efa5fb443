"""The engine's Python API (docs/engine.md: load_engine, run, generate, encode, decode) refuses bad
input with InputError, not a KeyError, AttributeError or TypeError from deep inside."""

from __future__ import annotations

import pytest

from specpilot.engine.api import load_engine
from specpilot.errors import InputError


@pytest.fixture(scope="module")
def eng():
    return load_engine("engine:model=tiny,mode=ar,threads=1")


@pytest.mark.parametrize("spec", [42, None, {"model": "tiny"}])
def test_load_engine_takes_a_spec_or_its_text(spec):
    with pytest.raises(InputError, match="load_engine takes an EngineSpec or its text"):
        load_engine(spec)


@pytest.mark.parametrize("prompts,msg", [
    ([{"text": "abc"}], "prompt #0: no 'id'"),
    ([{"ids": [1, 2]}], "prompt #0: no 'id'"),
    ([], "no prompts"),
    ("abc", "prompts must be a list"),
    ({"id": 0, "ids": [1]}, "prompts must be a list"),
    ([[1, 2]], "prompt #0: a prompt is a dict"),
    ([{"id": 1.5, "ids": [1]}], "'id' must be a string or an integer"),
    ([{"id": 3, "ids": [1]}, {"id": "3", "ids": [2]}], "prompt #1: id '3' is given twice"),
    ([{"id": 0, "ids": [1], "text": "a"}], "'ids' or 'text', not both"),
])
def test_run_refuses_prompts_that_are_no_list_of_prompt_dicts(eng, prompts, msg):
    with pytest.raises(InputError, match=msg):
        eng.run(prompts, max_new_tokens=2)


def test_run_takes_numpy_integer_ids(eng):
    """An id from a numpy array is an integer (it was refused as 'not an integer')."""
    import numpy as np

    r = eng.run([{"id": np.int64(1), "ids": [1, 2, 3]}], 2)
    assert r.results[0]["id"] == 1


def test_a_batched_run_refuses_them_too():
    eng = load_engine("engine:model=tiny,mode=ar,threads=1,batch=2")
    with pytest.raises(InputError, match="prompt #0: no 'id'"):
        eng.run([{"text": "abc"}], max_new_tokens=2)
    assert [r["id"] for r in eng.run([{"id": "a", "text": "abc"}, {"id": 1, "ids": [1, 2]}], 2).results] == ["a", 1]


@pytest.mark.parametrize("text", [5, None, b"abc"])
def test_encode_takes_text(eng, text):
    with pytest.raises(InputError, match="encode takes text"):
        eng.encode(text)


@pytest.mark.parametrize("ids,msg", [
    (5, "decode takes a sequence of token ids"), (None, "decode takes a sequence"), ("abc", "decode takes a sequence"),
    ([1.5], "1.5 is no token id of model tiny"), ([-1], "-1 is no token id"), ([256], "256 is no token id"),
    ([[1]], r"\[1\] is no token id"),
])
def test_decode_takes_token_ids_of_the_vocabulary(eng, ids, msg):
    with pytest.raises(InputError, match=msg):
        eng.decode(ids)


def test_good_input_still_runs(eng):
    r = eng.run([{"id": 0, "text": "abc"}], max_new_tokens=2)
    assert r.results[0]["prompt_ids"] == [97, 98, 99] == eng.encode("abc") and eng.decode([104, 105]) == "hi"
    with pytest.raises(InputError, match="no chat template"):
        eng.encode_messages([{"role": "user", "content": "hi"}])
