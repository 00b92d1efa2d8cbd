"""SGLang's KV-canary plan on a CPU, read from lists instead of element by element: the same
verify entries and write metadata, in the same order, written to the same plan tensors.

On a CPU SGLang plans each forward's canary verify with
`kernels/ops/kv_canary/plan_ref.py: _materialize_verify_entries`, which reads every position of
every request's window with its own `.item()` (the slot, its predecessor, each translated through
the full-to-SWA mapping, the expected token): a few thousand tensor reads a step on a CPU server.
`install` puts `materialize_verify_entries` in its place (and `materialize_write_metadata` in
`_materialize_write_metadata`'s, whose per-request reads are the same): each input read once as a
list, the same loop over plain integers. Wherever the reference would fail on an index (a request row, a
position or a slot outside its tensor, a negative index the reference would wrap), the
reference itself runs, so its error is the one raised; a release whose planner takes other
arguments keeps its own. tests/test_server_canary_verify.py holds
the two to the same plan tensors and return value over random inputs.
"""

from __future__ import annotations

import inspect
from types import ModuleType

import torch

__all__ = ["install", "materialize_verify_entries", "materialize_write_metadata"]


# What `_entries` reads of the reference's keyword arguments.
_ENTRY_INPUTS = ("req_pool_indices_host", "prefix_lens_host", "req_to_token_host", "swa_window_size", "lut", "bs",
                 "expected_token_pool_host", "req_to_verify_expected_tokens_valid_lens_host",
                 "kv_token_id_vs_position_offset")


# What `_write_metadata` reads of the reference's.
_WRITE_INPUTS = ("req_pool_indices_host", "prefix_lens_host", "extend_seq_lens_host", "req_to_token_host", "lut",
                 "write_req_capacity", "bs")


def _rows(tensor: torch.Tensor | None) -> list | None:
    return None if tensor is None else tensor.tolist()


def _entries(*, req_pool_indices_host, prefix_lens_host, req_to_token_host, swa_window_size, lut, bs,
             expected_token_pool_host, req_to_verify_expected_tokens_valid_lens_host,
             kv_token_id_vs_position_offset, padding: int) -> tuple[list[int], ...] | None:
    """The reference's four entry lists, or None where it would index outside a tensor."""
    pool_rows = req_to_token_host.shape[0]
    row_len = req_to_token_host.shape[1]
    lookup = _rows(lut)
    token_pool = expected_token_pool_host
    valid_lens = _rows(req_to_verify_expected_tokens_valid_lens_host)
    request_rows = req_pool_indices_host.tolist()
    prefix_lens = prefix_lens_host.tolist()
    if len(request_rows) < bs or len(prefix_lens) < bs or (valid_lens is not None and len(valid_lens) < bs):
        return None
    slots: list[int] = []
    positions: list[int] = []
    expected_ids: list[int] = []
    prev_slots: list[int] = []
    wanted: dict[int, tuple[list, list | None]] = {}
    for r in range(bs):
        row, prefix_len = request_rows[r], prefix_lens[r]
        if row == padding:
            continue
        window_start = max(0, prefix_len - swa_window_size) if swa_window_size > 0 else 0
        if prefix_len - window_start <= 0:
            continue
        if not 0 <= row < pool_rows or prefix_len > row_len:
            return None
        if row not in wanted:
            tokens = None
            if token_pool is not None:
                if row >= token_pool.shape[0]:
                    return None
                tokens = token_pool[row].tolist()
            wanted[row] = (req_to_token_host[row].tolist(), tokens)
        full_slots, tokens = wanted[row]
        valid_len = valid_lens[r] if valid_lens is not None else 0
        for position in range(window_start, prefix_len):
            pair = []
            for at in (position, position - 1):
                if at < 0:
                    pair.append(-1)
                    continue
                slot = full_slots[at]
                if lookup is not None and slot >= 0:
                    if slot >= len(lookup):
                        return None
                    slot = lookup[slot]
                pair.append(slot)
            expected = -1
            if tokens is not None:
                at = position + kv_token_id_vs_position_offset
                if 0 <= at < valid_len:
                    if at >= len(tokens):
                        return None
                    expected = tokens[at]
            slots.append(pair[0])
            positions.append(position)
            expected_ids.append(expected)
            prev_slots.append(pair[1])
    return slots, positions, expected_ids, prev_slots


def materialize_verify_entries(reference, padding: int):
    """`_materialize_verify_entries` over lists (`reference`: the original, run where it would
    raise; `padding`: SGLang's `REQ_POOL_IDX_PADDING`)."""

    def materialize(**arguments) -> int:
        entries = _entries(**{name: arguments[name] for name in _ENTRY_INPUTS}, padding=padding)
        if entries is None:
            return reference(**arguments)
        total = len(entries[0])
        if total == 0 or total > arguments["verify_capacity"]:  # on overflow the plan is left as it was
            return total
        plan = arguments["verify_plan_out"]
        targets = (plan.verify_slot_indices, plan.verify_expected_positions,
                   plan.verify_expected_tokens, plan.verify_prev_slot_indices)
        for target, values in zip(targets, entries, strict=True):
            _copy_into(target[:total], values)
        return total

    return materialize


def _write_metadata(*, req_pool_indices_host, prefix_lens_host, extend_seq_lens_host, req_to_token_host, lut,
                    write_req_capacity, bs, padding: int) -> tuple[list[int], list[int]] | None:
    """The reference's write offsets and seed slots, or None where it would index outside a tensor."""
    request_rows, prefix_lens = req_pool_indices_host.tolist(), prefix_lens_host.tolist()
    extend_lens = extend_seq_lens_host.tolist()
    if min(len(request_rows), len(extend_lens)) < bs or len(prefix_lens) < min(bs, write_req_capacity):
        return None
    pool_rows, row_len = req_to_token_host.shape[0], req_to_token_host.shape[1]
    lookup = _rows(lut)
    offsets, running = [], 0
    for r in range(bs):
        offsets.append(running)
        if request_rows[r] != padding and extend_lens[r] > 0:
            running += extend_lens[r]
    offsets.append(running)
    seeds = []
    for r in range(min(bs, write_req_capacity)):
        row, prefix_len = request_rows[r], prefix_lens[r]
        if row == padding or extend_lens[r] <= 0 or prefix_len <= 0:
            seeds.append(-1)
            continue
        if not 0 <= row < pool_rows or row_len <= 0:
            return None
        slot = req_to_token_host[row, min(prefix_len - 1, row_len - 1)].item()
        if lookup is not None and slot >= 0:
            if slot >= len(lookup):
                return None
            slot = lookup[slot]
        seeds.append(slot)
    return offsets, seeds


def materialize_write_metadata(reference, padding: int):
    """`_materialize_write_metadata` over lists (`reference`: the original, run where it would
    raise; `padding`: SGLang's `REQ_POOL_IDX_PADDING`)."""

    def materialize(**arguments) -> None:
        listed = _write_metadata(**{name: arguments[name] for name in _WRITE_INPUTS}, padding=padding)
        if listed is None:
            return reference(**arguments)
        offsets, seeds = listed
        plan, bs = arguments["write_plan_out"], arguments["bs"]
        length = int(plan.write_offsets.shape[0])
        copied = min(bs + 1, length)
        _copy_into(plan.write_offsets[:copied], offsets[:copied])
        if copied < length:
            plan.write_offsets[copied:].zero_()
        if seeds:
            _copy_into(plan.write_seed_slot_indices[:len(seeds)], seeds)
        plan.write_num_valid_reqs.fill_(int(bs))
        return None

    return materialize


def _copy_into(target: torch.Tensor, values: list[int]) -> None:
    target.copy_(torch.tensor(values, dtype=torch.int64).to(target.dtype).to(target.device))


def install(module: ModuleType) -> None:
    """In `module` (`sglang.kernels.ops.kv_canary.plan_ref`), plan the verify over lists, keeping
    the original as `_materialize_verify_entries_scalar` (idempotent)."""
    if getattr(module, "__canary_listed__", False):
        return
    padding = int(module.REQ_POOL_IDX_PADDING)
    # Another release's planner (other arguments): its own reference runs.
    known = {*_ENTRY_INPUTS, "verify_plan_out", "verify_capacity", "work_device"}
    if set(inspect.signature(module._materialize_verify_entries).parameters) == known:
        module._materialize_verify_entries_scalar = module._materialize_verify_entries
        module._materialize_verify_entries = materialize_verify_entries(module._materialize_verify_entries, padding)
    known = {*_WRITE_INPUTS, "write_plan_out", "work_device"}
    if set(inspect.signature(module._materialize_write_metadata).parameters) == known:
        module._materialize_write_metadata_scalar = module._materialize_write_metadata
        module._materialize_write_metadata = materialize_write_metadata(module._materialize_write_metadata, padding)
    module.__canary_listed__ = True
