"""The engine's input checks that need no model: ``check_prompt_tokens`` (a prompt is a
one-dimensional sequence of integer token ids: booleans, boolean tensors, floats, strings and
shapes other than [N] are refused, naming the request or the prompt's place in the batch and the
position) and ``model_vocab_size`` (an int, or None when the model has none)."""

from __future__ import annotations

import math
import pickle
from types import SimpleNamespace

import numpy as np
import pytest

from prefixkv.engine.model import model_vocab_size
from prefixkv.engine.request import InvalidRequestTokens, check_prompt_tokens


# -- check_prompt_tokens -------------------------------------------------------------------------------

def test_prompt_tensors_must_be_one_dimensional_naming_the_shape():
    torch = pytest.importorskip("torch")
    from prefixkv.engine.request import InvalidRequestTokens, check_prompt_tokens

    # an [N, 1] tensor (a batch of one column) was read as N tokens
    for prompt in (torch.tensor([[1], [2], [3]]), np.array([[1], [2], [3]]), torch.tensor([[1, 2]]),
                   torch.tensor(5)):
        with pytest.raises(InvalidRequestTokens, match=r"one-dimensional.*shape \(") as info:
            check_prompt_tokens(prompt, 100, request_id="r")
        assert "request 'r'" in str(info.value)
        copy = pickle.loads(pickle.dumps(info.value))
        assert str(copy) == str(info.value)
    with pytest.raises(InvalidRequestTokens, match="prompt 2 of the batch.*shape"):
        check_prompt_tokens(np.zeros((2, 2), np.int64), None, prompt_index=2)
    assert check_prompt_tokens(torch.tensor([4, 5]), 100, request_id="r") == (4, 5)
    assert check_prompt_tokens(np.array([4, 5]), 100, request_id="r") == (4, 5)


def test_a_boolean_tensor_token_is_named_by_its_dtype():
    torch = pytest.importorskip("torch")
    from prefixkv.engine.request import InvalidRequestTokens, check_prompt_tokens

    with pytest.raises(InvalidRequestTokens, match=r"position 0 is not an integer \(.*torch\.bool") as info:
        check_prompt_tokens(torch.tensor([True, False]), 100, request_id="r")
    assert "(Tensor)" not in str(info.value)
    with pytest.raises(InvalidRequestTokens, match=r"position 1 is not an integer \(.*float32"):
        check_prompt_tokens([1, np.float32(2.0)], 100, request_id="r")
    with pytest.raises(InvalidRequestTokens, match=r"not an integer \(str\)"):
        check_prompt_tokens([1, "2"], 100, request_id="r")


def test_a_prompt_that_is_not_a_sequence_is_refused_naming_the_request():
    from prefixkv.engine.request import InvalidRequestTokens, check_prompt_tokens

    with pytest.raises(InvalidRequestTokens, match="request 'r'.*int"):
        check_prompt_tokens(5, 100, request_id="r")


# -- check_prompt_tokens and booleans ---------------------------------------------------------------

@pytest.mark.parametrize("bad", [True, False])
def test_check_prompt_tokens_refuses_booleans(bad):
    # True/False were taken as token ids 1 and 0
    with pytest.raises(InvalidRequestTokens) as info:
        check_prompt_tokens([5, bad, 7], 100, request_id="r1")
    assert info.value.position == 1 and info.value.token is bad
    assert "'r1'" in str(info.value) and "position 1" in str(info.value) and "bool" in str(info.value)
    with pytest.raises(InvalidRequestTokens, match="prompt 3 of the batch.*position 0"):
        check_prompt_tokens([bad], None, prompt_index=3)


def test_check_prompt_tokens_refuses_boolean_tensors_and_keeps_integers():
    torch = pytest.importorskip("torch")
    with pytest.raises(InvalidRequestTokens, match="position 2"):
        check_prompt_tokens([1, 0, torch.tensor(True)], 100, request_id="r")
    with pytest.raises(InvalidRequestTokens, match="position 0"):
        check_prompt_tokens(torch.tensor([True, False]), 100, request_id="r")
    assert check_prompt_tokens([1, np.int64(2), torch.tensor(3)], 100, request_id="r") == (1, 2, 3)
    assert check_prompt_tokens(torch.tensor([4, 5]), 100, request_id="r") == (4, 5)


# -- model_vocab_size ---------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [256.7, math.nan, math.inf, True, "256"])
def test_model_vocab_size_refuses_a_non_integer(value):
    # int(256.7) silently became 256
    with pytest.raises(ValueError, match="vocab_size"):
        model_vocab_size(SimpleNamespace(vocab_size=value))
    with pytest.raises(ValueError, match="vocab_size"):
        model_vocab_size(SimpleNamespace(config=SimpleNamespace(vocab_size=value)))


def test_model_vocab_size_keeps_integers():
    assert model_vocab_size(SimpleNamespace(vocab_size=256)) == 256
    assert model_vocab_size(SimpleNamespace(vocab_size=np.int64(64))) == 64
    assert model_vocab_size(SimpleNamespace(config=SimpleNamespace(vocab_size=32000.0))) == 32000
    assert model_vocab_size(SimpleNamespace()) is None
    with pytest.raises(ValueError, match="positive"):
        model_vocab_size(SimpleNamespace(vocab_size=0))
