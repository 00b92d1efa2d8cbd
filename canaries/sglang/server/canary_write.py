"""SGLang's KV-canary write on a CPU, read from lists instead of element by element: the same
canary records, violation rows, ring and counters as its torch reference.

On a CPU SGLang writes each forward's canary records with
`kernels/ops/kv_canary/write_ref.py: launch_canary_write_kernel_torch_reference`, which reads every
entry's slot, token and position with its own `.item()` and stores each record field by field
into a copy of the canary buffer: a tenth of a CPU server's scheduler time. `write` is the same
walk over plain integers: each input read once as a list, the requests' chains hashed with SGLang's
own `splitmix64_mix3`, the records of the launch kept by slot (a later request whose seed is a slot
this launch wrote reads that record, as the reference reads its buffer copy) and stored into the
copy at once, the real-K/V fingerprints folded over all written slots at once
(`canary_verify.real_kv_hashes`). A launch the reference would refuse or fail on (a record
stride under four words, expected inputs given or missing against the flag, an index outside its
tensor) runs the reference itself, so its error is the one raised. tests/test_server_canary_write.py
holds the two to the same buffer, ring and counters over random launches.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from canaries.sglang.server.canary_verify import real_kv_hashes

__all__ = ["install", "listed_write"]


def _ints(tensor: torch.Tensor) -> list[int]:
    return tensor.detach().to(device="cpu", dtype=torch.int64).reshape(-1).tolist()


def _regular(offsets: list[int], seeds: list[int], active: int, lengths: list[int], locations: list[int],
             rows: int) -> bool:
    """Whether the reference would index only inside its tensors for these entries."""
    if active >= len(offsets):
        return False
    total = offsets[active]
    gathered = {slot for slot in locations[:max(total, 0)] if slot >= 0}
    for r in range(active):
        start, end = offsets[r], offsets[r + 1]
        if end - start <= 0:
            continue
        if start < 0 or end > min(lengths) or seeds[r] >= rows:
            return False
        if any(slot >= rows or slot not in gathered for slot in locations[start:end] if slot >= 0):
            return False
    return True


def listed_write(reference):
    """`launch_canary_write_kernel_torch_reference` over lists (`reference`: the original, run
    for a launch it would refuse or fail on)."""

    def write(**arguments: Any) -> None:
        from sglang.kernels.ops.kv_canary import consts
        from sglang.kernels.ops.kv_canary.verify_ref import (
            _to_signed_int64,
            materialize_real_kv_sources,
            splitmix64,
            splitmix64_mix3,
        )

        context, plan = arguments["context"], arguments["plan"]
        enable_write_input_assert = arguments["enable_write_input_assert"]
        expected_input_tokens = arguments["expected_input_tokens"]
        expected_input_positions = arguments["expected_input_positions"]
        # Read first, change nothing: an irregular launch goes to the reference whole.
        active = max(0, min(int(plan.write_num_valid_reqs.detach().to("cpu").item()),
                            int(plan.write_seed_slot_indices.shape[0])))
        canary_buf = context.canary_buf
        buf = canary_buf.detach().to(device="cpu").contiguous().view(torch.int64)
        expected_given = (expected_input_tokens is not None, expected_input_positions is not None)
        if int(buf.shape[1]) < 4 or expected_given != ((True, True) if enable_write_input_assert else (False, False)):
            return reference(**arguments)
        offsets = _ints(plan.write_offsets)
        seeds = _ints(plan.write_seed_slot_indices[:active])
        ids, positions, locations = (_ints(arguments[name]) for name in ("input_ids", "positions", "out_cache_loc"))
        expected_ids = _ints(expected_input_tokens) if enable_write_input_assert else []
        expected_positions = _ints(expected_input_positions) if enable_write_input_assert else []
        lengths = [len(ids), len(positions), len(locations)]
        if enable_write_input_assert:
            lengths += [len(expected_ids), len(expected_positions)]
        if active > 0 and not _regular(offsets, seeds, active, lengths, locations, int(buf.shape[0])):
            return reference(**arguments)

        chain_assert = int(context.enable_chain_position_assert.detach().to("cpu").item())
        context.kernel_run_counter.add_(1)
        if active <= 0 or offsets[active] <= 0:
            return None
        total = offsets[active]
        written_slots = [slot for slot in locations[:total] if slot >= 0]
        sources = materialize_real_kv_sources(real_kv_sources=context.real_kv_sources,
                                              real_kv_hash_mode=context.real_kv_hash_mode,
                                              slot_indices=written_slots, work_device=torch.device("cpu"))
        unique = sorted(set(written_slots))
        fingerprints = dict(zip(unique, real_kv_hashes(torch.tensor(unique, dtype=torch.int64), sources).tolist(),
                                strict=True)) if sources and unique else {}
        stored: dict[int, list[int]] = {}  # this launch's records by slot, the last one kept

        def field(slot: int, index: int) -> int:
            record = stored.get(slot)
            return record[index] if record is not None else int(buf[slot, index])

        kind = int(context.kernel_kind)
        violations: list[list[int]] = []
        count = 0
        for r in range(active):
            start, end = offsets[r], offsets[r + 1]
            if end - start <= 0:
                continue
            seed = seeds[r]
            if seed < 0:
                running = splitmix64(consts.CANARY_CHAIN_ANCHOR)
            else:
                running = splitmix64_mix3(field(seed, consts.CANARY_FIELD_PREV_HASH),
                                          field(seed, consts.CANARY_FIELD_TOKEN),
                                          field(seed, consts.CANARY_FIELD_POSITION))
            chained = seed >= 0 and chain_assert != 0
            previous_position = field(seed, consts.CANARY_FIELD_POSITION) if chained else 0
            for entry in range(start, end):
                slot = locations[entry]
                if slot < 0:
                    continue
                token, position = ids[entry], positions[entry]
                if enable_write_input_assert:
                    want_token, want_position = expected_ids[entry], expected_positions[entry]
                    bits = (int(consts.FailReason.WRITE_TOKEN_MISMATCH) if token != want_token else 0) | \
                        (int(consts.FailReason.WRITE_POSITION_MISMATCH) if position != want_position else 0)
                    if bits:
                        violations.append(_violation(consts, kind, slot, position, token, want_token,
                                                     _to_signed_int64(running), want_position, bits))
                if chained:
                    if position != previous_position + 1:
                        violations.append(_violation(consts, kind, slot, position, token, token,
                                                     _to_signed_int64(running), previous_position + 1,
                                                     int(consts.FailReason.WRITE_POSITION_MISMATCH)))
                    previous_position = position
                record = [0] * 4
                record[consts.CANARY_FIELD_TOKEN] = token
                record[consts.CANARY_FIELD_POSITION] = position
                record[consts.CANARY_FIELD_PREV_HASH] = _to_signed_int64(running)
                record[consts.CANARY_FIELD_REAL_KV_HASH] = fingerprints.get(slot, 0)
                stored[slot] = record
                running = splitmix64_mix3(running, token, position)
                count += 1

        if stored:
            out = buf.clone()
            slots = torch.tensor(list(stored), dtype=torch.int64)
            out[slots, :4] = torch.tensor(list(stored.values()), dtype=torch.int64)
            canary_buf.view(torch.int64).copy_(out.to(canary_buf.device).view(canary_buf.shape[0], -1))
        context.slot_run_counter.add_(count)
        if violations:
            _to_ring(context, violations)
        return None

    return write


def _violation(consts: Any, kind: int, slot: int, position: int, token: int, expected_token: int,
               chain: int, aux: int, bits: int) -> list[int]:
    row = [0] * consts.VIOLATION_FIELDS
    row[consts.VIOLATION_FIELD_KERNEL_KIND] = kind
    row[consts.VIOLATION_FIELD_SLOT_IDX] = slot
    row[consts.VIOLATION_FIELD_POSITION] = position
    row[consts.VIOLATION_FIELD_STORED_TOKEN] = token
    row[consts.VIOLATION_FIELD_EXPECTED_TOKEN] = expected_token
    row[consts.VIOLATION_FIELD_STORED_CHAIN_HASH] = chain
    row[consts.VIOLATION_FIELD_EXPECTED_AUX] = aux
    row[consts.VIOLATION_FIELD_FAIL_REASON_BITS] = bits
    return row


def _to_ring(context: Any, violations: list[list[int]]) -> None:
    """The reference's ring write: as many rows as fit from the write index on, the index advanced
    by all of them."""
    ring, write_index = context.violation_ring, context.violation_write_index
    base = int(write_index.detach().to("cpu").item())
    in_ring = max(0, min(len(violations), int(ring.shape[0]) - base))
    if in_ring > 0:
        host = ring.detach().to(device="cpu")
        host[base:base + in_ring, :] = torch.tensor(violations[:in_ring], dtype=torch.int64)
        ring.copy_(host.to(ring.device))
    write_index[0] = write_index[0] + len(violations)


def install(module: ModuleType) -> None:
    """In `module` (`sglang.kernels.ops.kv_canary.write_ref`), write over lists, keeping the
    original as `launch_canary_write_kernel_torch_reference_scalar` (idempotent)."""
    if getattr(module, "__canary_listed__", False):
        return
    module.launch_canary_write_kernel_torch_reference_scalar = module.launch_canary_write_kernel_torch_reference
    module.launch_canary_write_kernel_torch_reference = listed_write(module.launch_canary_write_kernel_torch_reference)
    module.__canary_listed__ = True
