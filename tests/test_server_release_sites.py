"""Which hook sites a release's server has a place for: read from its sources, and a kind acting
at a site the release lacks is refused with the reason, never silently skipped."""

from __future__ import annotations

from pathlib import Path

from canaries.sglang.runtime import spec_refusals
from canaries.sglang.server.release_sites import HOOK_POINTS, READ_BY_EVERY_SITE, missing_sites


def _package(root: Path, leave_out: str = "") -> Path:
    """A stand-in `sglang` directory defining every hook point except `leave_out`."""
    files: dict[str, list[str]] = {}
    for points in (*HOOK_POINTS.values(), READ_BY_EVERY_SITE):
        for file, name in points:
            if name != leave_out:
                files.setdefault(file, []).append(name)
    for file, names in files.items():
        classes: dict[str, list[str]] = {}
        lines = []
        for name in names:
            owner, _, method = name.partition(".")
            if method:
                classes.setdefault(owner, []).append(method)
            else:
                lines.append(f"class {name}:\n    pass\n" if name[0].isupper() else f"def {name}():\n    pass\n")
        for owner, methods in classes.items():
            lines.append(f"class {owner}:\n" + "".join(f"    def {m}(self):\n        pass\n" for m in methods))
        path = root / file
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines), encoding="utf-8")
    return root


def test_missing_sites_is_empty_for_a_release_with_every_hook_point(tmp_path: Path) -> None:
    assert missing_sites(_package(tmp_path)) == {}


def test_missing_sites_names_the_function_a_release_lacks(tmp_path: Path) -> None:
    missing = missing_sites(_package(tmp_path, leave_out="Scheduler._relay_forward_payload"))
    assert missing == {"on_sampling": "its sources have no srt/managers/scheduler.py Scheduler._relay_forward_payload"}


def test_missing_request_record_leaves_no_site(tmp_path: Path) -> None:
    assert set(missing_sites(_package(tmp_path, leave_out="ReqKvInfo"))) == set(HOOK_POINTS)


def test_kind_at_a_site_the_release_lacks_is_refused_naming_the_release(tmp_path: Path) -> None:
    missing = missing_sites(_package(tmp_path, leave_out="Scheduler._relay_forward_payload"))
    spec = {"engine": {}, "perturbations": [{"kind": "swap_next_token"}]}
    (where, why), = spec_refusals(spec, missing, "0.5.21")
    assert where == "perturbations[0].kind"
    assert "SGLang 0.5.21's server cannot hook" in why and "_relay_forward_payload" in why
    assert spec_refusals(spec, {}, "0.5.22") == []
