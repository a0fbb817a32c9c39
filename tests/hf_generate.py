"""Greedy generation for the HF integration tests: plain, and through a ``PrefixKVStore`` cache
(invariants checked after every prompt)."""

import torch


def generate_plain(model, prompts, max_new_tokens=4):
    return [model.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False)[0].tolist()
            for p in prompts]


def generate_through(store, model, prompts, mode, max_new_tokens=4):
    outs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with store.cache(model, mode=mode) as cache:
            cache.prepare(ids)
            outs.append(model.generate(ids, cache=cache, max_new_tokens=max_new_tokens, do_sample=False)[0].tolist())
        store.check_invariants()
    return outs
