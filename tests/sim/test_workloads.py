"""The synthetic workload generator's configuration (``WorkloadConfig``): a fixed, non-negative int
seed (the same config gives the same trace), finite rates, times and means, numbers where numbers
are due, int counts in range (vocabularies up to 2**32), prompts never empty, and mix entries that
are (kind, weight) pairs."""

import math

import pytest

from prefixkv.sim.workloads import WorkloadConfig, generate_requests


# -- workload generator ---------------------------------------------------------------------------

SMALL = WorkloadConfig(name="review", num_requests=12)


def _field_error(field, **kwargs):
    with pytest.raises(ValueError) as info:
        WorkloadConfig(**kwargs)
    assert field in str(info.value), str(info.value)


@pytest.mark.parametrize("seed", [None, True, -1, 1.5, "0"])
def test_workload_seed_must_be_a_non_negative_int(seed):
    # seed=None was accepted and seeded numpy from the OS: a different trace on every call, with
    # "seed": null in the header of a file that promises "same config, same bytes".
    _field_error("seed", seed=seed)


def test_workload_with_a_fixed_seed_is_deterministic():
    from dataclasses import replace

    a, b = generate_requests(SMALL), generate_requests(replace(SMALL))
    assert [(r.timestamp, r.tokens, r.output_tokens, r.session) for r in a] == \
        [(r.timestamp, r.tokens, r.output_tokens, r.session) for r in b]


@pytest.mark.parametrize("field", ["session_rate", "think_time", "tool_time", "agent_think_time",
                                   "chat_turns", "agent_steps", "agent_turns"])
def test_workload_rates_times_and_means_must_be_finite(field):
    # session_rate=inf drew every session gap as 0.0: the loop that waits for a session to start
    # after the n-th request never ended (generate_requests hung). chat_turns/agent_steps/agent_turns
    # = inf failed in numpy ("p <= 0, p > 1 or p contains NaNs") without naming the field; an
    # infinite time wrote Infinity (not JSON) into the header.
    _field_error(field, **{field: math.inf})


@pytest.mark.parametrize("field", ["session_rate", "think_time", "chat_turns", "tenant_zipf"])
def test_workload_float_fields_must_be_numbers(field):
    _field_error(field, **{field: "4"})


@pytest.mark.parametrize("field,value", [
    ("num_requests", 2.5),        # failed later: "list indices must be integers"
    ("num_requests", True),       # taken as 1
    ("vocab_size", 2.5),          # token ids drawn from [0, 2) while the header said 2.5
    ("block_size", 2.5),          # written into the header, refused by the loader
    ("num_tenants", 2.5),
    ("templates_per_tenant", 2.5),
    ("user_tokens", (1.5, 3)),    # a float bound was accepted
    ("user_tokens", (False, True)),
    ("vocab_size", 2**32 + 1),    # token ids the hasher and the trace loader refuse
])
def test_workload_counts_must_be_ints_in_range(field, value):
    _field_error(field, **{field: value})


def test_workload_vocab_of_2_pow_32_is_the_largest():
    assert WorkloadConfig(vocab_size=2**32).vocab_size == 2**32
    _field_error("vocab_size", vocab_size=2**32 + 1)


def test_workload_never_writes_an_empty_prompt():
    # The check "system prompts need at least one token" looked at the upper bound only: with
    # (0, 1) a tenant's system prompt could be empty, and with empty questions so was the request.
    _field_error("system_prompt_tokens", system_prompt_tokens=(0, 1), question_tokens=(0, 0),
                 mix=(("oneshot", 1.0),))
    requests = generate_requests(WorkloadConfig(num_requests=30, system_prompt_tokens=(1, 1),
                                                question_tokens=(0, 0), mix=(("oneshot", 1.0),)))
    assert min(r.input_length for r in requests) == 1


@pytest.mark.parametrize("mix", [
    (("chat",),),                 # ValueError "not enough values to unpack"
    (("chat", math.inf),),        # probabilities became NaN inside numpy
    (("chat", "1"),),
    (("chat", True),),
    "chat",
])
def test_workload_mix_entries_are_kind_weight_pairs(mix):
    _field_error("mix", mix=mix)
