"""``prefixkv.costs``: cost profile files (a bad field names the file, the field and its line; wrong
types are refused) and the preemption cost model (what it cannot price is refused; a swap is priced
in bytes over the link)."""

from __future__ import annotations

import math

import pytest

from prefixkv.costs import CostParams, load_params
from prefixkv.errors import InvalidArgument

# -- cost profile files: a bad field names the file, the field and its line ---------------------------

@pytest.mark.parametrize("name, text, field, line", [
    ("a.json", '{\n  "base": "h200",\n  "prefill_s_per_token": "abc"\n}\n', "prefill_s_per_token", 3),
    ("b.toml", 'base = "cpu-tiny"\n\nlink_bytes_per_s = 0\n', "link_bytes_per_s", 3),
    ("c.json", '{"decode_s_per_token": 1e999}', "decode_s_per_token", 1),
])
def test_cost_file_bad_value_names_file_field_and_line(tmp_path, name, text, field, line):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        load_params(path)
    msg = str(info.value)
    assert f"{path}:{line}" in msg and field in msg


@pytest.mark.parametrize("text, field", [
    ('{"read_whole_blocks": "no"}', "read_whole_blocks"),        # a truthy string: whole blocks read
    ('{"decode_s_per_token": true}', "decode_s_per_token"),       # true is not 1 s per token
    ('{"name": 5}', "name"),
    ('{"base": ["h200"]}', "base"),                               # was TypeError: unhashable type
])
def test_cost_file_wrong_type_is_refused(tmp_path, text, field):
    path = tmp_path / "p.json"
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        load_params(path)
    assert str(path) in str(info.value) and field in str(info.value)


def test_cost_params_checks_types_when_built_directly():
    with pytest.raises(ValueError, match="read_whole_blocks"):
        CostParams(read_whole_blocks="no")
    with pytest.raises(ValueError, match="prefill_s_per_token"):
        CostParams(prefill_s_per_token=True)
    assert CostParams(read_whole_blocks=False).read_whole_blocks is False


# -- the preemption cost model ---------------------------------------------------------------------

@pytest.mark.parametrize("field, bad", [
    ("kv_bytes_per_token", math.nan),        # every swap compared false: never chosen, silently
    ("kv_bytes_per_token", math.inf),
    ("kv_bytes_per_token", True),
    ("kv_bytes_per_token", "128"),           # TypeError: '<=' not supported
    ("prefill_tokens_per_s", math.inf),      # recompute always free
    ("prefill_tokens_per_s", math.nan),
    ("link_bytes_per_s", math.inf),
    ("link_bytes_per_s", "fast"),
    ("mode", None),
])
def test_preemption_cost_model_refuses_what_it_cannot_price(field, bad):
    from prefixkv.costs import PreemptionCostModel

    with pytest.raises(InvalidArgument) as info:
        PreemptionCostModel(**{field: bad})
    assert info.value.argument == field


def test_preemption_cost_model_prices_a_swap_in_bytes_over_the_link():
    from prefixkv.costs import GiB, KiB, PreemptionCostModel

    model = PreemptionCostModel()
    # 500 MiB out and back at 25 GiB/s, against 4,000 tokens at 20,000 tokens/s
    blocks = 500 * 2**20 // (16 * 128 * KiB)
    choice = model.choose(tokens=4000, blocks=blocks, block_size=16, host_blocks_free=blocks)
    assert choice.swap_s == pytest.approx(2 * 500 / (25 * 1024))
    assert choice.recompute_s == pytest.approx(0.2) and choice.mode == "swap"
    assert model.link_bytes_per_s == 25 * GiB
