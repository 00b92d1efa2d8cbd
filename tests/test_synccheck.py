"""engine_stub.synccheck: every would-be sync class is flagged, every sync-free form is not."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from engine_stub.synccheck import (
    SyncCheck,
    SyncDetected,
    SyncRecord,
    assert_no_sync,
    count_syncs,
    synccheck,
)

# Stand-ins for device tensors, made outside any check; in-place forms work on a clone.
_T = torch.arange(8)
_MASK = _T > 3
_IDX = torch.tensor([1, 3])
_SCALAR = torch.tensor(5)
_GRID = torch.tensor([[1, 2], [1, 2], [3, 4]])
_SCALAR_READ = "aten::_local_scalar_dense"

# Each lambda stays on one line: its first line is where the op runs, which the site must name.
SYNCING = [
    pytest.param(lambda: _SCALAR.item(), _SCALAR_READ, id="item"),
    pytest.param(lambda: bool(_SCALAR), _SCALAR_READ, id="bool"),
    pytest.param(lambda: int(_SCALAR), _SCALAR_READ, id="int"),
    pytest.param(lambda: float(_SCALAR), _SCALAR_READ, id="float"),
    pytest.param(lambda: 1 if _SCALAR else 0, _SCALAR_READ, id="if-tensor"),
    pytest.param(lambda: list(range(8))[_SCALAR], _SCALAR_READ, id="index-dunder"),
    pytest.param(lambda: torch.equal(_T, _T), "aten::equal", id="equal"),
    pytest.param(lambda: torch.allclose(_T.float(), _T.float()), "aten::allclose", id="allclose"),
    pytest.param(lambda: _T.tolist(), "Tensor.tolist", id="tolist"),
    pytest.param(lambda: _T.numpy(), "Tensor.numpy", id="numpy"),
    pytest.param(lambda: np.asarray(_T), "Tensor.numpy", id="np-asarray"),
    pytest.param(lambda: torch.nonzero(_T), "aten::nonzero", id="torch-nonzero"),
    pytest.param(lambda: _T.nonzero(), "aten::nonzero", id="tensor-nonzero"),
    pytest.param(lambda: _T.nonzero(as_tuple=True), "aten::nonzero", id="nonzero-tuple"),
    pytest.param(lambda: torch.where(_MASK), "aten::nonzero", id="where-1-arg"),
    pytest.param(lambda: torch.argwhere(_T), "aten::nonzero", id="argwhere"),
    pytest.param(lambda: _T[_MASK], "bool-mask index", id="mask-read"),
    pytest.param(lambda: _GRID[:, torch.tensor([True, False])], "bool-mask index", id="mask-dim1"),
    pytest.param(lambda: _T.clone().__setitem__(_MASK, 0), "bool-mask index", id="mask-write"),
    pytest.param(lambda: _T.masked_select(_MASK), "aten::masked_select", id="masked-select"),
    pytest.param(lambda: torch.unique(_T), "aten::_unique2", id="torch-unique"),
    pytest.param(lambda: _T.unique(return_counts=True), "aten::_unique2", id="tensor-unique"),
    pytest.param(lambda: torch.unique(_GRID, dim=0), "aten::unique_dim", id="unique-dim"),
    pytest.param(
        lambda: torch.unique_consecutive(_GRID), "aten::unique_consecutive", id="unique-consec"
    ),
    pytest.param(
        lambda: torch.repeat_interleave(_T, _T), "aten::repeat_interleave", id="repeat-interleave"
    ),
    pytest.param(
        lambda: torch.repeat_interleave(_IDX), "aten::repeat_interleave", id="repeat-counts"
    ),
    pytest.param(
        lambda: _T.clone().__setitem__(_IDX, 0), "host-scalar aten::index_put_", id="setitem-0"
    ),
    pytest.param(
        lambda: _T.clone().index_put_((_IDX,), torch.tensor(0)),
        "host-scalar aten::index_put_",
        id="index-put-0dim",
    ),
    pytest.param(
        lambda: torch.index_put(_T, (_IDX,), torch.tensor(0)),
        "host-scalar aten::index_put",
        id="index-put-out-of-place",
    ),
]

SYNC_FREE = [
    pytest.param(lambda: _T[_IDX], id="int-tensor-index"),
    pytest.param(lambda: _T.index_select(0, _IDX), id="index-select"),
    pytest.param(lambda: _T.gather(0, _IDX), id="gather"),
    pytest.param(lambda: _T.clone().index_fill_(0, _IDX, 0), id="index-fill"),
    pytest.param(lambda: _T.clone().scatter_(0, _IDX, _IDX), id="scatter"),
    pytest.param(lambda: _T.clone().index_copy_(0, _IDX, _IDX), id="index-copy"),
    pytest.param(lambda: _T.clone().__setitem__(_IDX, _IDX * 2), id="setitem-same-shape"),
    pytest.param(lambda: torch._assert_async(_SCALAR > 0), id="assert-async"),
    pytest.param(lambda: (_T * 2 + 1) // 3, id="arithmetic"),
    pytest.param(lambda: _T.sum(), id="sum"),
    pytest.param(lambda: torch.where(_MASK, _T, 0), id="where-3-arg"),
    pytest.param(lambda: _T.masked_fill(_MASK, 0), id="masked-fill"),
    pytest.param(lambda: torch.cat([_T, _T]), id="cat"),
    pytest.param(lambda: _T[2:5], id="slice"),
    pytest.param(lambda: _T[3], id="int-index"),
    pytest.param(lambda: _T.clone(), id="clone"),
    pytest.param(lambda: torch.repeat_interleave(_T, _T, output_size=28), id="ri-output-size"),
    pytest.param(lambda: _T.repeat_interleave(2), id="ri-int-repeats"),
    pytest.param(lambda: torch.nonzero_static(_T, size=8), id="nonzero-static"),
]


@pytest.mark.parametrize(("fn", "op"), SYNCING)
def test_syncing_op_is_flagged_once_at_its_call_site(fn: Callable[[], object], op: str) -> None:
    check = count_syncs(fn)

    assert [(r.op, r.count) for r in check.records] == [(op, 1)]
    assert check.records[0].site.endswith(
        f"test_synccheck.py:{fn.__code__.co_firstlineno} in <lambda>"
    )


@pytest.mark.parametrize("fn", SYNC_FREE)
def test_sync_free_form_is_not_flagged(fn: Callable[[], object]) -> None:
    check = count_syncs(fn)

    assert check.total == 0, check.summary()
    assert_no_sync(fn)


def test_assert_no_sync_lists_each_record_in_the_error() -> None:
    def filter_then_read() -> None:
        _T[_MASK]
        _SCALAR.item()

    with pytest.raises(SyncDetected) as excinfo:
        assert_no_sync(filter_then_read)

    message = str(excinfo.value)
    assert "2 would-be device sync(s)" in message
    assert "bool-mask index at " in message
    assert f"{_SCALAR_READ} at " in message
    assert "test_synccheck.py:" in message and "in filter_then_read x 1" in message


def test_count_syncs_aggregates_one_site_into_one_record() -> None:
    def read_each(values: list[torch.Tensor]) -> None:
        for value in values:
            value.item()

    check = count_syncs(read_each, [torch.tensor(i) for i in range(5)])

    assert len(check.records) == 1
    assert check.records[0].op == _SCALAR_READ
    assert check.records[0].count == 5
    assert check.total == 5


def test_count_syncs_keeps_sites_in_first_seen_order() -> None:
    def two_sites() -> None:
        _T.tolist()
        _T.nonzero()
        _T.tolist()

    check = count_syncs(two_sites)

    assert [(r.op, r.count) for r in check.records] == [
        ("Tensor.tolist", 1),
        ("aten::nonzero", 1),
        ("Tensor.tolist", 1),
    ]
    assert len({r.site for r in check.records}) == 3
    assert check.summary().splitlines() == [
        f"{r.op} at {r.site} x {r.count}" for r in check.records
    ]


def test_sync_record_is_frozen() -> None:
    record = SyncRecord("aten::nonzero", "here.py:1 in f", 1)

    with pytest.raises(AttributeError):
        record.count = 2  # type: ignore[misc]


@pytest.mark.parametrize("name", ["tolist", "numpy"])
@pytest.mark.parametrize("raises", [False, True], ids=["clean-exit", "raising-exit"])
def test_patched_attribute_is_restored_after_exit(name: str, raises: bool) -> None:
    original = getattr(torch.Tensor, name)
    was_own = name in vars(torch.Tensor)

    with pytest.raises(KeyError) if raises else contextlib.nullcontext():
        with synccheck(cuda_sync_debug=False):
            assert getattr(torch.Tensor, name) is not original
            if raises:
                raise KeyError("boom")

    assert getattr(torch.Tensor, name) is original
    assert (name in vars(torch.Tensor)) == was_own
    assert _get_current_dispatch_mode() is None


def test_nested_checks_each_record_the_inner_op() -> None:
    with synccheck(cuda_sync_debug=False) as outer:
        _T.tolist()
        with synccheck(cuda_sync_debug=False) as inner:
            _T.nonzero()
            _T.tolist()

    assert [r.op for r in inner.records] == ["aten::nonzero", "Tensor.tolist"]
    assert [r.op for r in outer.records] == ["Tensor.tolist", "aten::nonzero", "Tensor.tolist"]
    assert outer.total == 3
    assert torch.Tensor.tolist is torch._C.TensorBase.tolist


def test_reentering_one_check_counts_each_sync_once() -> None:
    check = synccheck(cuda_sync_debug=False)
    assert isinstance(check, SyncCheck)

    with check, check:
        _SCALAR.item()
        _T.tolist()

    assert check.total == 2
    assert _get_current_dispatch_mode() is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_cuda_sync_debug_true_without_cuda_raises() -> None:
    with pytest.raises(ValueError, match="needs a CUDA device"):
        synccheck(cuda_sync_debug=True)


# PR #36723: the pre-fix forms must be flagged before a clean post-fix form means anything.
def _swa_mapping() -> tuple[torch.Tensor, torch.Tensor]:
    """A full->SWA mapping with padding slot 0, and the full indices being freed."""
    mapping = torch.tensor([0, 5, 0, 7, 6, -1])
    return mapping, torch.tensor([1, 3, 4])


def test_pr36723_peer_filter_is_flagged() -> None:
    mapping, free_index = _swa_mapping()
    peers = mapping[free_index]

    check = count_syncs(lambda: peers[peers > 0])

    assert [r.op for r in check.records] == ["bool-mask index"]


def test_pr36723_host_scalar_clear_is_flagged() -> None:
    mapping, free_index = _swa_mapping()

    check = count_syncs(mapping.__setitem__, free_index, 0)

    assert [r.op for r in check.records] == ["host-scalar aten::index_put_"]
    assert "test_pr36723_host_scalar_clear_is_flagged" in check.records[0].site


def test_pr36723_index_fill_clear_is_not_flagged_and_matches() -> None:
    mapping, free_index = _swa_mapping()
    expected = mapping.clone()
    expected[free_index] = 0
    peers = mapping[free_index]
    assert count_syncs(lambda: peers[peers > 0]).total == 1

    assert_no_sync(mapping.index_fill_, 0, free_index, 0)

    assert torch.equal(mapping, expected)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_check_on_cuda_arms_sync_debug_error_and_restores_it() -> None:
    mapping = torch.tensor([0, 5, 0, 7], device="cuda")
    free_index = torch.tensor([1, 3], device="cuda")
    torch.cuda.synchronize()
    before = torch.cuda.get_sync_debug_mode()

    with synccheck() as check:
        assert torch.cuda.get_sync_debug_mode() == 2
    assert torch.cuda.get_sync_debug_mode() == before
    assert check.total == 0

    with pytest.raises(SyncDetected, match="bool-mask index"):
        assert_no_sync(lambda: mapping[mapping > 0])
    assert torch.cuda.get_sync_debug_mode() == before
    assert_no_sync(mapping.index_fill_, 0, free_index, 0)
