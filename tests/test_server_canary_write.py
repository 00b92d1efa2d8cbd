"""SGLang's KV-canary write read from lists (canaries/sglang/server/canary_write.py) against SGLang's
own torch reference, unmodified, on the same launches, in every SGLang server venv here: the same
canary buffer (every word), violation ring, write index and both counters, and where the reference
raises, the same exception. Random launches: padding slots, a slot written twice, a seed that is
a slot the same launch wrote, chains that break, write-input asserts on and off, every real-KV
mode, page sizes 1 and 16, a ring that overflows, and launches the reference refuses or fails on."""

from __future__ import annotations

import textwrap

import pytest

SIDE_BY_SIDE = textwrap.dedent("""
    import random, sys
    import torch
    sys.path.insert(0, sys.argv[1])
    from sglang.kernels.ops.kv_canary import consts, write_ref
    from sglang.kernels.ops.kv_canary.verify import RealKvSource, VerifyOrWriteContext
    from sglang.kernels.ops.kv_canary.write import WritePlan
    from canaries.sglang.server.canary_write import listed_write

    reference = write_ref.launch_canary_write_kernel_torch_reference
    listed = listed_write(reference)
    rng = random.Random(3)
    seen = {"violations": 0, "raised": 0, "seed_written_here": 0, "overflow": 0}

    def launch(case):
        page = rng.choice([1, 16])
        rows = 32 * page
        mode = rng.choice(list(consts.RealKvHashMode))
        k = torch.randn(32, page * 32 // 4)
        sources = (RealKvSource(tensor=k, page_size=page, num_bytes_per_token=32, read_bytes=rng.choice([16, 32])),)
        requests = rng.randint(1, 4)
        offsets, seeds, loc, ids, pos = [0], [], [], [], []
        for r in range(requests):
            n = rng.randrange(0, 7)
            seeds.append(rng.choice([-1, rng.randrange(1, rows), loc[-1] if loc and loc[-1] >= 0 else -1]))
            start = rng.randrange(0, 5)
            for i in range(n):
                loc.append(rng.choice([-1] + [rng.randrange(1, rows)] * 5 + ([loc[-1]] if loc else [])))
                ids.append(rng.randrange(256))
                pos.append(start + i + (1 if rng.random() < 0.1 else 0))
            offsets.append(offsets[-1] + n)
        if loc and rng.random() < 0.05:
            loc[rng.randrange(len(loc))] = rows + 3  # a slot outside the buffer
        if rng.random() < 0.05:
            seeds[0] = rows + 1
        asserting = rng.random() < 0.5
        expected_ids = [t + (1 if rng.random() < 0.1 else 0) for t in ids]
        expected_pos = [p + (1 if rng.random() < 0.1 else 0) for p in pos]
        if rng.random() < 0.04:
            asserting = not asserting  # the expected inputs given against the flag: refused
            mismatch = True
        else:
            mismatch = False
        given = asserting != mismatch
        capacity = requests + rng.choice([0, 2])
        base = torch.randint(-(1 << 40), 1 << 40, (rows, rng.choice([4, 4, 6])), dtype=torch.int64)
        ring_rows, chain = rng.choice([2, 16]), rng.choice([0, 1])
        state = []
        for function in (reference, listed):
            ctx = VerifyOrWriteContext(
                canary_buf=base.clone().view(torch.uint8), kernel_kind=5,
                violation_ring=torch.zeros(ring_rows, consts.VIOLATION_FIELDS, dtype=torch.int64),
                violation_write_index=torch.tensor([1], dtype=torch.int32),
                slot_run_counter=torch.zeros(1, dtype=torch.int64), kernel_run_counter=torch.zeros(1, dtype=torch.int64),
                real_kv_sources=sources, real_kv_hash_mode=mode,
                enable_chain_position_assert=torch.tensor([chain], dtype=torch.int32))
            padded = offsets + [offsets[-1]] * (capacity + 1 - len(offsets))
            plan = WritePlan(write_offsets=torch.tensor(padded, dtype=torch.int64),
                             write_seed_slot_indices=torch.tensor(seeds + [0] * (capacity - requests), dtype=torch.int64),
                             write_num_valid_reqs=torch.tensor([requests], dtype=torch.int32))
            try:
                function(context=ctx, plan=plan, input_ids=torch.tensor(ids, dtype=torch.int64),
                         positions=torch.tensor(pos, dtype=torch.int64), out_cache_loc=torch.tensor(loc, dtype=torch.int64),
                         enable_write_input_assert=asserting,
                         expected_input_tokens=torch.tensor(expected_ids, dtype=torch.int64) if given else None,
                         expected_input_positions=torch.tensor(expected_pos, dtype=torch.int64) if given else None)
                error = None
            except Exception as exc:
                error = type(exc).__name__
            state.append((error, ctx.canary_buf.view(torch.int64).tolist(), ctx.violation_ring.tolist(),
                          ctx.violation_write_index.tolist(), ctx.slot_run_counter.tolist(),
                          ctx.kernel_run_counter.tolist()))
        assert state[0] == state[1], (case, state[0][0], state[1][0], state[0][2:], state[1][2:])
        seen["raised"] += state[0][0] is not None
        seen["violations"] += state[0][3][0] > 1
        seen["overflow"] += state[0][3][0] > ring_rows
        seen["seed_written_here"] += any(s >= 0 and s in loc[:offsets[i]] for i, s in enumerate(seeds))

    for case in range(500):
        launch(case)
    assert all(count >= 5 for count in seen.values()), seen
    print("same 500")
""")


@pytest.mark.parametrize("release", ["0.5.23", "0.5.22"])
def test_listed_write_matches_sglang_reference(release: str, in_server_venv) -> None:
    assert in_server_venv(release, SIDE_BY_SIDE) == "same 500"


WIRED = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    from canaries.sglang.server import cpu_standins

    cpu_standins.install()  # what every SGLang process of a CPU server runs first (sitecustomize)
    from sglang.kernels.ops.kv_canary import plan_ref, verify_ref, write_ref

    assert write_ref.launch_canary_write_kernel_torch_reference.__qualname__.startswith("listed_write")
    assert write_ref._compute_real_kv_hash_scalar.__qualname__.startswith("_write_hash")  # its fallback's hashes
    assert plan_ref._materialize_verify_entries.__qualname__.startswith("materialize_verify_entries")
    assert plan_ref._materialize_write_metadata.__qualname__.startswith("materialize_write_metadata")
    assert verify_ref.launch_canary_verify_kernel_torch_reference.__name__ == "verify"
    print("wired")
""")


def test_cpu_standins_put_every_listed_canary_launch_in_place(in_server_venv) -> None:
    env = {"SGLANG_USE_CPU_ENGINE": "1", "TRITON_INTERPRET": "1", "PATH": "/usr/bin:/bin"}
    assert in_server_venv("0.5.23", WIRED, env) == "wired"
