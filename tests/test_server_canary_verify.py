"""SGLang's KV-canary verify, vectorized (canaries/sglang/server/canary_verify.py), against SGLang's own torch
reference on the same inputs: the same violation rows in the same order, counters and ring; the
real-K/V fingerprint slot by slot; and the write reference with its fingerprints folded at once
against the reference as it is (the same canary buffer, ring and counters).

Runs in the server venv (`make-sglang-venv.sh --server`), where SGLang's reference lives; skips
without it. Random canary buffers and K/V sources, chains made consistent and then damaged
(a token, a position, a chain link, a K/V byte, a slot's whole record), padding slots, chain
heads, every real-KV mode, page sizes 1 and 16, a ring that overflows."""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import pytest

from canaries.sglang.releases.venvs import find_python

REPO = Path(__file__).resolve().parents[1]
PYTHON = find_python("0.5.23", server=True)
pytestmark = pytest.mark.skipif(PYTHON is None, reason="no SGLang server venv: bash scripts/make-sglang-venv.sh --server")

CHECK = textwrap.dedent("""
    import random, sys
    import torch
    sys.path.insert(0, sys.argv[1])
    from sglang.kernels.ops.kv_canary import consts, verify_ref
    from sglang.kernels.ops.kv_canary.verify import RealKvSource, VerifyOrWriteContext, VerifyPlan
    from canaries.sglang.server.canary_verify import splitmix64, verify

    rng = random.Random(7)
    U64 = (1 << 64) - 1

    def signed(v):
        v &= U64
        return v - (1 << 64) if v >= 1 << 63 else v

    # splitmix64 on int64 tensors against SGLang's Python one, extreme values included.
    values = [0, 1, -1, (1 << 63) - 1, -(1 << 63)] + [rng.getrandbits(64) for _ in range(2000)]
    got = splitmix64(torch.tensor([signed(v) for v in values], dtype=torch.int64)).tolist()
    assert got == [signed(consts.splitmix64(v)) for v in values], "splitmix64 differs"

    def case(seed, page, mode, damage, ring_capacity, check_tokens):
        rng = random.Random(seed)
        slots_total = 64 * page
        nbytes = 32
        k = torch.randn(slots_total // page, page * nbytes // 4)
        v = torch.randn(slots_total // page, page * nbytes // 4)
        sources = (RealKvSource(tensor=k, page_size=page, num_bytes_per_token=nbytes, read_bytes=nbytes),
                   RealKvSource(tensor=v, page_size=page, num_bytes_per_token=nbytes, read_bytes=16))
        buf = torch.zeros(slots_total, 4, dtype=torch.int64)
        chain = rng.sample(range(1, slots_total), 40)
        ctx_sources = sources if mode != consts.RealKvHashMode.NONE else ()
        mat = verify_ref.materialize_real_kv_sources(real_kv_sources=ctx_sources, real_kv_hash_mode=mode,
                                                     slot_indices=chain, work_device=torch.device("cpu"))
        prev_hash = consts.splitmix64(consts.CANARY_CHAIN_ANCHOR)
        tokens = []
        for pos, slot in enumerate(chain):
            token = rng.randrange(256)
            tokens.append(token)
            buf[slot] = torch.tensor([token, pos, signed(prev_hash),
                                      signed(verify_ref._compute_real_kv_hash_scalar(slot_idx=slot, host_sources=mat))])
            prev_hash = consts.splitmix64_mix3(prev_hash, token, pos)
        entries = [(slot, tokens[i], i, chain[i - 1] if i else -1) for i, slot in enumerate(chain)]
        entries.insert(5, (0, 0, 0, 0))  # the padding slot: never verified
        entries.insert(9, (chain[3], tokens[3], 3, 0))  # an unreachable predecessor
        if damage == "token":
            buf[chain[7], 0] += 1
        elif damage == "position":
            buf[chain[11], 1] = 99
        elif damage == "link":
            buf[chain[13], 2] ^= 1
        elif damage == "kv":
            k.view(torch.uint8)[chain[17] // page, (chain[17] % page) * nbytes + 3] ^= 0x10
        elif damage == "record":
            buf[chain[21]] = torch.tensor([rng.getrandbits(63) for _ in range(4)])
        elif damage == "expected":
            entries[30] = (entries[30][0], entries[30][1] + 1, entries[30][2], entries[30][3])
        capacity = len(entries) + 6
        def plan():
            p = VerifyPlan(verify_slot_indices=torch.zeros(capacity, dtype=torch.int64),
                           verify_expected_tokens=torch.full((capacity,), -1, dtype=torch.int64),
                           verify_expected_positions=torch.zeros(capacity, dtype=torch.int64),
                           verify_prev_slot_indices=torch.zeros(capacity, dtype=torch.int64),
                           verify_num_valid=torch.tensor([len(entries)], dtype=torch.int32),
                           enable=torch.ones(1, dtype=torch.int32))
            for i, (slot, token, pos, prev) in enumerate(entries):
                p.verify_slot_indices[i], p.verify_expected_tokens[i] = slot, token
                p.verify_expected_positions[i], p.verify_prev_slot_indices[i] = pos, prev
            return p
        out = []
        for impl in (verify_ref.launch_canary_verify_kernel_torch_reference, verify):
            ctx = VerifyOrWriteContext(canary_buf=buf.view(torch.uint8).clone(), kernel_kind=3,
                                       violation_ring=torch.zeros(ring_capacity, consts.VIOLATION_FIELDS, dtype=torch.int64),
                                       violation_write_index=torch.tensor([1], dtype=torch.int32),
                                       slot_run_counter=torch.zeros(1, dtype=torch.int64),
                                       kernel_run_counter=torch.zeros(1, dtype=torch.int64),
                                       real_kv_sources=ctx_sources, real_kv_hash_mode=mode,
                                       enable_chain_position_assert=torch.ones(1, dtype=torch.int32))
            impl(context=ctx, plan=plan(), check_verify_expected_token=check_tokens)
            out.append((ctx.violation_ring.tolist(), ctx.violation_write_index.tolist(),
                        ctx.slot_run_counter.tolist(), ctx.kernel_run_counter.tolist()))
        assert out[0] == out[1], (seed, page, mode, damage, out)
        return out[0][1][0] - 1

    # The real-K/V fingerprint itself, slot by slot, against the reference's scalar fold.
    from canaries.sglang.server.canary_verify import real_kv_hashes
    for page in (1, 16):
        for mode in (consts.RealKvHashMode.PARTIAL, consts.RealKvHashMode.ALL):
            k = torch.randn(32, page * 64 // 4)
            v = torch.randn(32, page * 64 // 4)
            sources = (RealKvSource(tensor=k, page_size=page, num_bytes_per_token=64, read_bytes=48),
                       RealKvSource(tensor=v, page_size=page, num_bytes_per_token=64, read_bytes=64))
            slots = rng.sample(range(32 * page), min(50, 32 * page))
            mat = verify_ref.materialize_real_kv_sources(real_kv_sources=sources, real_kv_hash_mode=mode,
                                                         slot_indices=slots, work_device=torch.device("cpu"))
            want = [verify_ref._compute_real_kv_hash_scalar(slot_idx=s, host_sources=mat) for s in slots]
            got = [x & U64 for x in real_kv_hashes(torch.tensor(slots), mat).tolist()]
            assert got == want, (page, mode)

    # The write reference with its fingerprints folded at once: the same buffer and ring.
    from canaries.sglang.server.canary_verify import install_write
    from sglang.kernels.ops.kv_canary import write_ref
    from sglang.kernels.ops.kv_canary.write import WritePlan

    def write_case(seed, page, mode):
        rng = random.Random(seed)
        k = torch.randn(64, page * 32 // 4)
        sources = (RealKvSource(tensor=k, page_size=page, num_bytes_per_token=32, read_bytes=32),)
        offsets, seeds, loc, ids, pos = [0], [], [], [], []
        for r in range(4):
            n = rng.randrange(1, 9)
            seeds.append(rng.choice([-1, rng.randrange(1, 64 * page)]))
            start = rng.randrange(0, 5)
            for i in range(n):
                loc.append(rng.choice([-1] + [rng.randrange(1, 64 * page)] * 6))
                ids.append(rng.randrange(256))
                pos.append(start + i + (1 if i == 3 and r == 2 else 0))  # one broken chain step
            offsets.append(offsets[-1] + n)
        base = torch.randint(-(1 << 40), 1 << 40, (64 * page, 4), dtype=torch.int64)
        results = []
        for patched in (False, True):
            if patched:
                install_write(write_ref)
            ctx = VerifyOrWriteContext(canary_buf=base.clone().view(torch.uint8), kernel_kind=5,
                                       violation_ring=torch.zeros(16, consts.VIOLATION_FIELDS, dtype=torch.int64),
                                       violation_write_index=torch.tensor([0], dtype=torch.int32),
                                       slot_run_counter=torch.zeros(1, dtype=torch.int64),
                                       kernel_run_counter=torch.zeros(1, dtype=torch.int64),
                                       real_kv_sources=sources, real_kv_hash_mode=mode,
                                       enable_chain_position_assert=torch.ones(1, dtype=torch.int32))
            plan = WritePlan(write_offsets=torch.tensor(offsets + [offsets[-1]] * 2, dtype=torch.int64),
                             write_seed_slot_indices=torch.tensor(seeds + [0, 0], dtype=torch.int64),
                             write_num_valid_reqs=torch.tensor([4], dtype=torch.int32))
            write_ref.launch_canary_write_kernel_torch_reference(
                context=ctx, plan=plan, input_ids=torch.tensor(ids), positions=torch.tensor(pos),
                out_cache_loc=torch.tensor(loc), enable_write_input_assert=False,
                expected_input_tokens=None, expected_input_positions=None)
            results.append((ctx.canary_buf.view(torch.int64).tolist(), ctx.violation_ring.tolist(),
                            ctx.violation_write_index.tolist(), ctx.slot_run_counter.tolist()))
        assert results[0] == results[1], (seed, page, mode)
        return results[0]

    written = [write_case(seed, page, mode) for seed in range(2) for page in (1, 16)
               for mode in consts.RealKvHashMode]
    assert any(r[2][0] > 0 for r in written), "no broken chain step showed"

    found = 0
    for seed in range(3):
        for page in (1, 16):
            for mode in consts.RealKvHashMode:
                for damage in ("none", "token", "position", "link", "kv", "record", "expected"):
                    for ring, check in ((64, True), (2, False)):
                        found += case(seed, page, mode, damage, ring, check)
    assert found > 0, "no case produced a violation: the damage never showed"
    print("ok", found)
""")


@pytest.mark.slow
def test_vectorized_verify_matches_sglang_reference_byte_for_byte(tmp_path: Path) -> None:
    script = tmp_path / "check.py"
    script.write_text(CHECK, encoding="utf-8")
    proc = subprocess.run([str(PYTHON), str(script), str(REPO)], capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), proc.stdout[-2000:] + proc.stderr[-4000:]
