"""The model executor: runs a ``StepPlan`` through a real model and a ``KVStore`` (torch).

Order inside one step, as the manager's contract wants: the plan's block
copies first (swap-outs, swap-ins, copy-on-write, in the order the scheduler
made them), then one forward over the whole packed row, every layer writing
its K/V through the slot mapping before its attention reads the pool, then
sampling of the rows that end a request's known tokens.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from ..kv.storage import KVStore
from .model import PagedAttentionBackend, model_vocab_size
from .plan import StepOutput, StepPlan
from .sampling import sample


_BLOCK_OP_METHODS = {"swap_out": "swap_out", "demote": "demote", "swap_in": "swap_in", "load": "load",
                     "copy": "copy_blocks"}


class ModelExecutor:
    def __init__(self, model, kv_store: KVStore, *, impl: str = "auto",
                 timer: Callable[[], float] = time.perf_counter) -> None:
        self.model = model
        self.kv_store = kv_store
        self.impl = impl
        self.timer = timer

    @property
    def vocab_size(self) -> int | None:
        """The model's vocabulary size, None when the model does not say (see ``EngineModel``);
        the engine checks prompts against it when they are added."""
        return model_vocab_size(self.model)

    def run_block_ops(self, plan: StepPlan) -> None:
        store = self.kv_store
        # Every kind is checked before any block moves (an unknown one used to run as a device copy).
        unknown = [op.kind for op in plan.block_ops if op.kind not in _BLOCK_OP_METHODS]
        if unknown:
            raise ValueError(f"step {plan.step}: unknown block op kind {unknown[0]!r} "
                             f"(expected one of {', '.join(_BLOCK_OP_METHODS)})")
        for op in plan.block_ops:
            getattr(store, _BLOCK_OP_METHODS[op.kind])(op.pairs)

    def forward(self, plan: StepPlan) -> torch.Tensor:
        """Logits ``[requests that sample, vocab]`` of one packed forward."""
        batch = plan.packed()
        device = self.model.device
        backend = PagedAttentionBackend(
            self.kv_store, torch.from_numpy(batch.slot_mapping).to(device),
            torch.from_numpy(plan.block_tables), torch.from_numpy(batch.seq_lens),
            torch.from_numpy(batch.query_start_loc), impl=self.impl)
        with torch.inference_mode():
            hidden = self.model(torch.from_numpy(batch.token_ids).to(device),
                                torch.from_numpy(batch.positions).to(device), backend)
            return self.model.logits(hidden[torch.from_numpy(batch.sample_rows).to(device)])

    def execute(self, plan: StepPlan) -> StepOutput:
        start = self.timer()
        self.run_block_ops(plan)
        sampled = {}
        if plan.requests:
            logits = self.forward(plan)
            for row, req in enumerate(r for r in plan.requests if r.sample):
                sampled[req.request_id] = sample(logits[row], req.sampling, req.output_index)
        return StepOutput(sampled, self.timer() - start)
