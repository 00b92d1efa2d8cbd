"""SGLang's KV-canary plan read from lists (canaries/sglang/server/canary_plan.py) against SGLang's
own `_materialize_verify_entries` and `_materialize_write_metadata` on the same inputs, in every SGLang server venv here:
the same return value, the same plan tensors (every element, the untouched tail included), and
where the reference raises, the same exception. Random batches: padding rows, windows and no
window, the full-to-SWA mapping or none, negative slots, expected tokens with their valid lengths
and offsets, a capacity that overflows, and inputs that index outside their tensors."""

from __future__ import annotations

import textwrap

import pytest

SIDE_BY_SIDE = textwrap.dedent("""
    import random, sys
    import torch
    sys.path.insert(0, sys.argv[1])
    from sglang.kernels.ops.kv_canary import plan_ref
    from sglang.kernels.ops.kv_canary.verify import VerifyPlan
    from canaries.sglang.server import canary_plan

    reference = plan_ref._materialize_verify_entries
    listed = canary_plan.materialize_verify_entries(reference, int(plan_ref.REQ_POOL_IDX_PADDING))
    rng = random.Random(5)
    outcomes = {"entries": 0, "empty": 0, "overflow": 0, "raised": 0}

    def plan(capacity, seed):
        g = torch.Generator().manual_seed(seed)
        return VerifyPlan(
            verify_slot_indices=torch.randint(-9, 99, (capacity,), generator=g, dtype=torch.int64),
            verify_expected_tokens=torch.randint(-9, 99, (capacity,), generator=g, dtype=torch.int64),
            verify_expected_positions=torch.randint(-9, 99, (capacity,), generator=g, dtype=torch.int64),
            verify_prev_slot_indices=torch.randint(-9, 99, (capacity,), generator=g, dtype=torch.int64),
            verify_num_valid=torch.zeros(1, dtype=torch.int32), enable=torch.zeros(1, dtype=torch.int32))

    def run(function, arguments, seed):
        out = plan(arguments.pop("capacity"), seed)
        try:
            value = function(verify_plan_out=out, **arguments)
        except Exception as exc:
            value = ("raised", type(exc).__name__)
        return value, [t.tolist() for t in (out.verify_slot_indices, out.verify_expected_tokens,
                                            out.verify_expected_positions, out.verify_prev_slot_indices)]

    for case in range(600):
        rows, row_len, swa_pool = rng.randint(2, 6), rng.choice([8, 24]), rng.randint(4, 40)
        bs = rng.randint(1, 5)
        r2t = torch.tensor([[rng.choice([rng.randint(0, 60), -1]) if rng.random() < 0.1 else rng.randint(0, 60)
                             for _ in range(row_len)] for _ in range(rows)], dtype=torch.int64)
        lut = torch.randint(0, swa_pool, (rng.choice([61, 61, 61, 30]),), dtype=torch.int64) \\
            if rng.random() < 0.6 else None
        out_of_range = rng.random() < 0.08
        req = [rng.choice([0, rng.randint(1, rows - 1)]) for _ in range(bs)]
        if out_of_range:
            req[rng.randrange(bs)] = rng.choice([rows, -1])
        prefix = [rng.randint(0, row_len + (2 if out_of_range else 0)) for _ in range(bs)]
        pool = valid = None
        if rng.random() < 0.6:
            pool = torch.randint(0, 500, (rows, row_len + rng.choice([0, 4])), dtype=torch.int64)
            valid = torch.tensor([rng.randint(0, row_len + 6) for _ in range(bs)], dtype=torch.int64)
        arguments = dict(
            req_pool_indices_host=torch.tensor(req, dtype=torch.int64),
            prefix_lens_host=torch.tensor(prefix, dtype=torch.int64), req_to_token_host=r2t,
            swa_window_size=rng.choice([0, 4, 16]), lut=lut, verify_capacity=rng.choice([4, 64]),
            work_device=torch.device("cpu"), bs=bs, expected_token_pool_host=pool,
            req_to_verify_expected_tokens_valid_lens_host=valid,
            kv_token_id_vs_position_offset=rng.choice([0, 1, -1]))
        arguments["capacity"] = arguments["verify_capacity"]
        want = run(reference, dict(arguments), case)
        got = run(listed, dict(arguments), case)
        assert got == want, (case, arguments, want, got)
        value = want[0]
        kind = "raised" if isinstance(value, tuple) else "empty" if value == 0 else \\
            "overflow" if value > arguments["verify_capacity"] else "entries"
        outcomes[kind] += 1
    assert all(count >= 10 for count in outcomes.values()), outcomes

    # The write metadata: offsets, seed slots (translated), the valid count, on random batches.
    from sglang.kernels.ops.kv_canary.write import WritePlan

    write_reference = plan_ref._materialize_write_metadata
    write_listed = canary_plan.materialize_write_metadata(write_reference, int(plan_ref.REQ_POOL_IDX_PADDING))
    written = {"seeded": 0, "raised": 0}
    for case in range(600):
        rows, row_len, bs = rng.randint(2, 6), rng.choice([8, 24]), rng.randint(1, 5)
        r2t = torch.randint(-1, 61, (rows, row_len), dtype=torch.int64)
        lut = torch.randint(0, 40, (rng.choice([61, 61, 30]),), dtype=torch.int64) if rng.random() < 0.6 else None
        req = [rng.choice([0, rng.randint(1, rows - 1)]) for _ in range(bs)]
        if rng.random() < 0.08:
            req[rng.randrange(bs)] = rng.choice([rows, -1])
        capacity = rng.choice([2, 8])
        arguments = dict(
            req_pool_indices_host=torch.tensor(req, dtype=torch.int64),
            prefix_lens_host=torch.tensor([rng.randint(0, row_len + 3) for _ in range(bs)], dtype=torch.int64),
            extend_seq_lens_host=torch.tensor([rng.randint(-1, 9) for _ in range(bs)], dtype=torch.int64),
            req_to_token_host=r2t, lut=lut, write_req_capacity=capacity, work_device=torch.device("cpu"), bs=bs)
        state = []
        for function in (write_reference, write_listed):
            g = torch.Generator().manual_seed(case)
            out = WritePlan(write_offsets=torch.randint(-9, 99, (capacity + 1,), generator=g, dtype=torch.int64),
                            write_seed_slot_indices=torch.randint(-9, 99, (capacity,), generator=g, dtype=torch.int64),
                            write_num_valid_reqs=torch.zeros(1, dtype=torch.int32))
            try:
                value = function(write_plan_out=out, **arguments)
            except Exception as exc:
                value = ("raised", type(exc).__name__)
            state.append((value, out.write_offsets.tolist(), out.write_seed_slot_indices.tolist(),
                          out.write_num_valid_reqs.tolist()))
        assert state[0] == state[1], (case, arguments, state)
        written["raised" if isinstance(state[0][0], tuple) else "seeded"] += 1
    assert min(written.values()) >= 10, written
    print("same", sum(outcomes.values()) + sum(written.values()))
""")


@pytest.mark.parametrize("release", ["0.5.23", "0.5.22"])
def test_listed_verify_plan_matches_sglang_reference(release: str, in_server_venv) -> None:
    assert in_server_venv(release, SIDE_BY_SIDE) == "same 1200"
