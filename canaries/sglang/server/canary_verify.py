"""SGLang's KV-canary verify on a CPU, over all slots at once: the same result, byte for byte, as
SGLang's own torch reference.

On a CPU (no CUDA, so no JIT kernel) SGLang verifies its canary with
`kernels/ops/kv_canary/verify_ref.py: launch_canary_verify_kernel_torch_reference`, which walks
the slots one by one and folds each slot's real K/V bytes word by word in Python integers: with
`--kv-canary-real-data all` (as the suite launches it) that is most of a CPU server's time. This
module is the same computation on tensors: the same slots skipped, the same chain hash
(`splitmix64_mix3` of the predecessor's token, position and hash), the same real-KV fingerprint
(each source's bytes little-endian into 64-bit words, folded with `splitmix64`, sources folded
into one), the same fail bits, the same violation rows in the same order, the same counters and
ring writes. The 64-bit hashing runs on numpy uint64 arrays (wrapping multiplication, logical
shifts), whose calls cost a fraction of torch's. `install` puts it in place of the reference where SGLang looks it up
(`verify.py` imports it from `verify_ref` at each launch); `install_write` gives the write
reference (`write_ref.py`, whose chain walk stays its own) each slot's real-K/V fingerprint from
one fold over all the slots it gathered. tests/test_server_canary_verify.py holds both to SGLang's
reference on the same inputs.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
import torch

__all__ = ["install", "install_write", "real_kv_hashes", "splitmix64", "verify"]

_GOLDEN_1 = 0xBF58476D1CE4E5B9
_GOLDEN_2 = 0x94D049BB133111EB
_U_GOLDEN_1, _U_GOLDEN_2 = np.uint64(_GOLDEN_1), np.uint64(_GOLDEN_2)
_SHIFT_27, _SHIFT_30, _SHIFT_31 = np.uint64(27), np.uint64(30), np.uint64(31)


def _signed(value: int) -> int:
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """SGLang's `consts.splitmix64` on each int64 (its 64 bits read as unsigned)."""
    values = x.detach().to("cpu", torch.int64).contiguous().numpy().view(np.uint64).copy()
    _splitmix64_in_place(values, np.empty_like(values))
    return torch.from_numpy(values.view(np.int64))


def _mix3(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """SGLang's `splitmix64_mix3` of each (a, b, c), on uint64 arrays."""
    def words(t: torch.Tensor) -> np.ndarray:
        return t.contiguous().numpy().view(np.uint64)

    h = words(a).copy()
    scratch = np.empty_like(h)
    _splitmix64_in_place(h, scratch)
    for value in (words(b), words(c)):
        np.bitwise_xor(h, value, out=h)
        _splitmix64_in_place(h, scratch)
    return torch.from_numpy(h.view(np.int64))


def _fold_words(words: np.ndarray) -> np.ndarray:
    """`splitmix64(acc ^ word)` over each row's words left to right, from 0 (uint64 [n, w] -> [n]).
    numpy's uint64 wraps and shifts logically, and its calls cost a fraction of torch's: a
    fingerprint folds dozens of words a slot, one call chain each."""
    acc = np.zeros(words.shape[0], dtype=np.uint64)
    scratch = np.empty_like(acc)
    for column in np.ascontiguousarray(words.T):
        np.bitwise_xor(acc, column, out=acc)
        _splitmix64_in_place(acc, scratch)
    return acc


def _splitmix64_in_place(x: np.ndarray, scratch: np.ndarray) -> None:
    for shift, golden in ((_SHIFT_30, _U_GOLDEN_1), (_SHIFT_27, _U_GOLDEN_2)):
        np.right_shift(x, shift, out=scratch)
        np.bitwise_xor(x, scratch, out=x)
        np.multiply(x, golden, out=x)
    np.right_shift(x, _SHIFT_31, out=scratch)
    np.bitwise_xor(x, scratch, out=x)


def real_kv_hashes(slots: torch.Tensor, sources: tuple) -> torch.Tensor:
    """`verify_ref._compute_real_kv_hash_scalar` of every slot in `slots` (int64 [n]), from the
    sources `verify_ref.materialize_real_kv_sources` gathered."""
    if not sources:
        return torch.zeros_like(slots)
    slot_ids = slots.numpy()
    acc = np.zeros(slot_ids.shape[0], dtype=np.uint64)
    scratch = np.empty_like(acc)
    for source in sources:
        page = source.page_size
        rows = slot_ids // page
        lookup = np.full(int(rows.max()) + 1, -1, dtype=np.int64)
        for row, index in source.row_lookup.items():
            if row < lookup.shape[0]:
                lookup[row] = index
        col_start = (slot_ids % page) * source.num_bytes_per_token
        width = source.effective_read_bytes
        columns = col_start[:, None] + np.arange(width, dtype=np.int64)
        raw = source.tensor_u8.numpy()[lookup[rows][:, None], columns]  # [n, width] uint8
        pad = (8 - width % 8) % 8
        if pad:
            raw = np.concatenate([raw, np.zeros((raw.shape[0], pad), dtype=np.uint8)], axis=1)
        words = np.ascontiguousarray(raw).view("<u8")  # little-endian: byte k is bits 8k..8k+7
        np.bitwise_xor(acc, _fold_words(words), out=acc)
        _splitmix64_in_place(acc, scratch)
    return torch.from_numpy(acc.view(np.int64))


def verify(*, context, plan, check_verify_expected_token: bool) -> None:
    """`launch_canary_verify_kernel_torch_reference`, vectorized (see the module docstring)."""
    from sglang.kernels.ops.kv_canary import consts
    from sglang.kernels.ops.kv_canary.verify_ref import materialize_real_kv_sources

    cpu = torch.device("cpu")
    context.kernel_run_counter.add_(1)
    if int(plan.enable.detach().to("cpu").item()) == 0:
        return
    num_valid = int(plan.verify_slot_indices.new_empty(()).copy_(plan.verify_num_valid[0]).item())
    active = max(0, min(num_valid, int(plan.verify_slot_indices.shape[0])))
    if active <= 0:
        return
    slots = plan.verify_slot_indices[:active].to(device=cpu, dtype=torch.int64)
    if check_verify_expected_token:
        expected_ids = plan.verify_expected_tokens[:active].to(device=cpu, dtype=torch.int64)
    else:
        expected_ids = torch.full((active,), -1, dtype=torch.int64)
    expected_positions = plan.verify_expected_positions[:active].to(device=cpu, dtype=torch.int64)
    prev_slots = plan.verify_prev_slot_indices[:active].to(device=cpu, dtype=torch.int64)
    context.slot_run_counter.add_(active)

    # SGLang's padded-token dummy slot is never verified.
    kept = slots != consts.TOKEN_TO_KV_SLOT_PADDING
    slots, expected_ids = slots[kept], expected_ids[kept]
    expected_positions, prev_slots = expected_positions[kept], prev_slots[kept]
    if slots.numel() == 0:
        return
    buf = context.canary_buf.detach().to(device=cpu).contiguous().view(torch.int64)
    if int(buf.shape[1]) < 4:
        raise ValueError(f"kv-canary: canary_buf slot stride must hold at least 4 int64 fields, got {int(buf.shape[1])}")
    sources = materialize_real_kv_sources(real_kv_sources=context.real_kv_sources,
                                          real_kv_hash_mode=context.real_kv_hash_mode,
                                          slot_indices=slots.tolist(), work_device=cpu)
    stored = buf[slots]
    stored_token = stored[:, consts.CANARY_FIELD_TOKEN]
    stored_position = stored[:, consts.CANARY_FIELD_POSITION]
    stored_chain = stored[:, consts.CANARY_FIELD_PREV_HASH]
    stored_real = stored[:, consts.CANARY_FIELD_REAL_KV_HASH]

    # The predecessor's hash (`compute_slot_hash`): its fields mixed, or the anchor's for -1.
    reachable = prev_slots != consts.TOKEN_TO_KV_SLOT_PADDING
    head = prev_slots < 0
    prev = buf[prev_slots.clamp(min=0)]
    from_prev = _mix3(prev[:, consts.CANARY_FIELD_PREV_HASH], prev[:, consts.CANARY_FIELD_TOKEN],
                      prev[:, consts.CANARY_FIELD_POSITION])
    anchor = splitmix64(torch.tensor([_signed(consts.CANARY_CHAIN_ANCHOR)], dtype=torch.int64))
    expected_chain = torch.where(reachable, torch.where(head, anchor, from_prev), stored_chain)
    expected_real = real_kv_hashes(slots, sources)

    fail = torch.zeros_like(slots)
    fail |= torch.where(reachable & (stored_chain != expected_chain),
                        int(consts.FailReason.VERIFY_CHAIN_HASH_MISMATCH), 0)
    if check_verify_expected_token:
        fail |= torch.where((expected_ids != -1) & (stored_token != expected_ids),
                            int(consts.FailReason.VERIFY_TOKEN_MISMATCH), 0)
    fail |= torch.where(stored_position != expected_positions, int(consts.FailReason.VERIFY_POSITION_MISMATCH), 0)
    fail |= torch.where(stored_real != expected_real, int(consts.FailReason.VERIFY_REAL_KV_HASH_MISMATCH), 0)
    failed = fail != 0
    count = int(failed.sum())
    if count == 0:
        return
    rows = torch.zeros((count, consts.VIOLATION_FIELDS), dtype=torch.int64)
    rows[:, consts.VIOLATION_FIELD_KERNEL_KIND] = int(context.kernel_kind)
    rows[:, consts.VIOLATION_FIELD_SLOT_IDX] = slots[failed]
    rows[:, consts.VIOLATION_FIELD_POSITION] = stored_position[failed]
    rows[:, consts.VIOLATION_FIELD_STORED_TOKEN] = stored_token[failed]
    rows[:, consts.VIOLATION_FIELD_EXPECTED_TOKEN] = expected_ids[failed]
    rows[:, consts.VIOLATION_FIELD_STORED_CHAIN_HASH] = stored_chain[failed]
    rows[:, consts.VIOLATION_FIELD_EXPECTED_AUX] = expected_chain[failed]
    rows[:, consts.VIOLATION_FIELD_FAIL_REASON_BITS] = fail[failed]

    ring, write_index = context.violation_ring, context.violation_write_index
    base = int(write_index.new_empty(()).copy_(write_index[0]).item())
    in_ring = max(0, min(count, int(ring.shape[0]) - base))
    if in_ring > 0:
        ring_host = ring.detach().to(device=cpu)
        ring_host[base:base + in_ring, :] = rows[:in_ring, :]
        ring.copy_(ring_host.to(ring.device))
    write_index[0] = write_index[0] + count


class _WithHashes(tuple):
    """`materialize_real_kv_sources`'s tuple, carrying every requested slot's fingerprint."""

    hashes: dict[int, int]


def _write_materialize(original):
    def materialize(*, real_kv_sources, real_kv_hash_mode, slot_indices, work_device):
        sources = original(real_kv_sources=real_kv_sources, real_kv_hash_mode=real_kv_hash_mode,
                           slot_indices=slot_indices, work_device=work_device)
        out = _WithHashes(sources)
        slots = torch.tensor(list(slot_indices), dtype=torch.int64)
        hashes = real_kv_hashes(slots, sources) if slots.numel() else slots
        out.hashes = {slot: value & ((1 << 64) - 1) for slot, value in zip(slots.tolist(), hashes.tolist(), strict=True)}
        return out

    return materialize


def _write_hash(original):
    def compute(*, slot_idx, host_sources):
        hashes = getattr(host_sources, "hashes", None)
        if hashes is not None and slot_idx in hashes:
            return hashes[slot_idx]
        return original(slot_idx=slot_idx, host_sources=host_sources)

    return compute


def install_write(module: ModuleType) -> None:
    """In `module` (`sglang.kernels.ops.kv_canary.write_ref`), fold the real K/V of every slot a
    write launch gathers at once, when it gathers them: the reference's own loop then takes each
    slot's fingerprint from there (what `_compute_real_kv_hash_scalar` returns for it, as an
    unsigned 64-bit integer), and everything else it does is its own."""
    if getattr(module, "__canary_vectorized__", False):
        return
    module.materialize_real_kv_sources = _write_materialize(module.materialize_real_kv_sources)
    module._compute_real_kv_hash_scalar = _write_hash(module._compute_real_kv_hash_scalar)
    module.__canary_vectorized__ = True


def install(module: ModuleType) -> None:
    """Put `verify` in place of `module`'s (`sglang.kernels.ops.kv_canary.verify_ref`) torch
    reference, keeping the original as `launch_canary_verify_kernel_torch_reference_scalar`."""
    if getattr(module, "__canary_vectorized__", False):
        return
    module.launch_canary_verify_kernel_torch_reference_scalar = module.launch_canary_verify_kernel_torch_reference
    module.launch_canary_verify_kernel_torch_reference = verify
    module.__canary_vectorized__ = True
