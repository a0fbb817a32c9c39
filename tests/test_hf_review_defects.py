"""Defects found in review of the Hugging Face cache integration (each test failed before its fix).

Same tiny random-weight Llama as tests/test_hf.py; outputs compared with transformers' DynamicCache."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the HF integration needs torch")
pytest.importorskip("transformers", reason="transformers is not installed (pip install 'prefixkv[hf]')")
try:
    import prefixkv.integrations.hf  # noqa: F401
except ImportError as exc:  # an unsupported transformers version
    pytest.skip(str(exc), allow_module_level=True)

from transformers import LlamaForCausalLM  # noqa: E402

from test_hf import SYSTEM, _config, _ids, _left_pad, _reference, _store  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return LlamaForCausalLM(_config()).eval()


def test_lazy_admission_with_a_chunk_that_is_all_padding_for_a_row_says_to_prepare(model):
    """No prepare() and prefill_chunk_size smaller than a row's left padding: the first chunk holds
    no token of that row. The cache refuses, naming the cause and the remedy, instead of claiming
    the row 'is all padding' (it is not), and holds nothing afterwards."""
    store = _store(model)
    ids, mask = _left_pad([_ids(60, 20), _ids(61, 5)])          # row 1: 15 padding columns
    with store.cache(model) as cache:
        with pytest.raises(ValueError, match=r"row 1 has no token in the first forward.*prefill_chunk_size.*"
                                             r"cache\.prepare\(input_ids, attention_mask\)"):
            model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=3, do_sample=False,
                           prefill_chunk_size=8)
        assert cache.batch_size == 0
        # The remedy works: prepared, the same call equals DynamicCache.
        cache.prepare(ids, mask)
        out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=3, do_sample=False,
                             prefill_chunk_size=8)
    assert torch.equal(out, _reference(model, ids, mask, max_new_tokens=3, prefill_chunk_size=8))
    store.check_invariants()
    assert store.stats().active_blocks == 0
