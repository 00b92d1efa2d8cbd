"""The native column of `canary matrix`, reused across runs by content hash.

Every matrix runs the same scenarios on our own engine (`memory: native`) to put each release's
cell beside. That run depends only on the engine's and the harness's code and on the scenario, so
each scenario's result is kept under a key over both:

    key = sha256(the .py files of engine_stub/ and canaries/, python's and torch's versions,
                 the scenario as loaded (its resolved engine, workload, perturbations, expect,
                 path) and its file's bytes)

in `$CANARY_CACHE_DIR` (default `~/.cache/serving-canary`)`/native/<code digest>/<key>/`: its
verdict record (`record.json`) and its run directory (`run/`: events, engine log, responses). A
matrix takes each scenario it finds there and runs the rest, then stores what it ran; a plain
`canary run` of our engine (local runtime, no device, memory, interpreter or engine override)
stores its results too, so that the gate's matrices after it reuse them. Any edit
of the engine or the harness changes the code digest, so nothing is reused across code changes;
a harness failure or an interrupted scenario is never stored. Digests not used for
`KEEP_DAYS` are removed when a new one is stored.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.metadata
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["CACHE_ENV", "NativeCache", "code_digest", "run_native", "scenario_key", "store_run"]

CACHE_ENV = "CANARY_CACHE_DIR"
KEEP_DAYS = 7
_ROOT = Path(__file__).resolve().parents[1]
_CODE_DIRS = ("engine_stub", "canaries")


def code_digest(root: Path = _ROOT) -> str:
    """One sha256 over every .py file of the engine and the harness (paths and contents), and
    the versions of python and torch they run on."""
    digest = hashlib.sha256()
    for part in _CODE_DIRS:
        for path in sorted((root / part).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = "none"
    # The same code on a machine with a CUDA device may run a scenario's `device: auto` there.
    cuda = any(Path("/dev").glob("nvidia[0-9]*"))
    digest.update(f"python {sys.version}\0torch {torch_version}\0cuda {cuda}".encode())
    return digest.hexdigest()


def scenario_key(scenario: Any, digest: str) -> str:
    """The cache key of `scenario`'s native run under code `digest`."""
    text = Path(scenario.path).read_bytes() if os.path.isfile(scenario.path) else b""
    if dataclasses.is_dataclass(scenario):  # one scenario file however its path was spelled
        scenario = dataclasses.replace(scenario, path=os.path.abspath(scenario.path))
    return hashlib.sha256(f"{digest}\0{scenario!r}\0".encode() + text).hexdigest()


def _storable(record: Any) -> bool:
    extra = getattr(record, "extra", None) or {}
    return not extra.get("interrupted") and not extra.get("harness_error")


class NativeCache:
    """The native runs kept for this code (`code_digest`), under `root`."""

    def __init__(self, root: str | os.PathLike | None = None, digest: str | None = None) -> None:
        base = Path(root or os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "serving-canary")
        self.digest = digest or code_digest()
        self.dir = base / "native" / self.digest[:24]

    def lookup(self, scenario: Any) -> tuple[Any, Path] | None:
        """(the kept record, its run directory) for `scenario`, or None."""
        from canaries.verdict.record import VerdictRecord

        entry = self.dir / scenario_key(scenario, self.digest)
        try:
            data = json.loads((entry / "record.json").read_text(encoding="utf-8"))
            record = VerdictRecord(**data)
        except (OSError, ValueError, TypeError):
            return None
        return (record, entry / "run") if (entry / "run").is_dir() else None

    def kept(self, scenarios: Sequence[Any]) -> dict[str, tuple[Any, Path]]:
        """Scenario name -> (record, run directory) for each of `scenarios` kept here."""
        return {sc.name: hit for sc in scenarios if (hit := self.lookup(sc)) is not None}

    def store(self, scenario: Any, record: Any, run_dir: Path) -> bool:
        """Keep `record` and a copy of `run_dir` for `scenario`; False when it is not kept (an
        interrupted scenario or a harness failure, or another run stored it first)."""
        if not _storable(record) or not run_dir.is_dir():
            return False
        entry = self.dir / scenario_key(scenario, self.digest)
        if entry.is_dir():
            return False
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / f".{entry.name}.{os.getpid()}.tmp"
        try:
            shutil.copytree(run_dir, tmp / "run", symlinks=True)
            (tmp / "record.json").write_text(json.dumps(record.to_dict(), default=str) + "\n", encoding="utf-8")
            tmp.rename(entry)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            return False
        return True

    def prune(self, keep_days: float = KEEP_DAYS) -> None:
        """Remove other code digests' entries not used for `keep_days`."""
        cutoff = time.time() - keep_days * 86400
        with contextlib.suppress(OSError):
            for other in self.dir.parent.iterdir():
                if other != self.dir and other.is_dir() and other.stat().st_mtime < cutoff:
                    shutil.rmtree(other, ignore_errors=True)


def store_run(scenarios: Sequence[Any], records: Sequence[Any], report_dir: Path,
              cache: NativeCache | None = None) -> int:
    """Keep a finished `canary run`'s results (our engine, the local runtime, no override of
    device, memory, interpreter or engine sources: what a matrix's native column runs) for the
    matrices that follow; how many were stored. Never raises: the run's reports are what count."""
    try:
        cache = cache or NativeCache()
        by_name = {r.scenario: r for r in records}
        stored = sum(cache.store(sc, by_name[sc.name], report_dir / sc.name)
                     for sc in scenarios if sc.name in by_name)
        cache.prune()
    except Exception:  # noqa: BLE001 - a cache that cannot be written is only a slower next matrix
        return 0
    return stored


def run_native(scenarios: Sequence[Any], report_dir: Path, run: Callable[[Sequence[Any], Path], list],
               cache: NativeCache | None, kept: dict[str, tuple[Any, Path]] | None = None,
               log: Callable[[str], None] = print) -> tuple[list, int]:
    """The native column's records, in `scenarios`' order, and how many came from `cache`.

    `kept`: `cache.kept(scenarios)` if the caller looked already. `run(scenarios, report_dir)`
    runs the ones not kept (`runner.run_many` with the matrix's
    jobs, latch and display) into `report_dir`; the kept ones' run directories are copied
    beside them, and `verdicts.jsonl`, junit.xml, the kill matrix and index.html are written
    for the whole column."""
    if cache is None:
        return run(scenarios, report_dir), 0
    kept = cache.kept(scenarios) if kept is None else kept
    missing = [sc for sc in scenarios if sc.name not in kept]
    log(f"matrix: native column: {len(kept)} of {len(scenarios)} scenario(s) from the cache "
        f"({cache.dir}), {len(missing)} to run")
    ran = {r.scenario: r for r in run(missing, report_dir)} if missing else {}
    for sc in missing:
        record = ran.get(sc.name)
        if record is not None:
            cache.store(sc, record, report_dir / sc.name)
    if not kept:
        cache.prune()
        return [ran[sc.name] for sc in scenarios], 0
    from canaries.report import append_verdict
    from canaries.runner import _finish as write_run_reports

    report_dir.mkdir(parents=True, exist_ok=True)
    records = []
    for sc in scenarios:
        if sc.name in ran:
            records.append(ran[sc.name])
            continue
        record, run_dir = kept[sc.name]
        target = report_dir / sc.name
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(run_dir, target, symlinks=True)
        extra = {**record.extra, "run_dir": str(target), "native_cache": str(run_dir.parent)}
        records.append(type(record)(**{**record.to_dict(), "extra": extra}))
    verdicts = report_dir / "verdicts.jsonl"
    verdicts.unlink(missing_ok=True)
    for record in records:
        append_verdict(verdicts, record)
    durations = {r.scenario: float(r.extra.get("duration_s") or 0.0) for r in records}
    write_run_reports(report_dir, records, durations)
    cache.prune()
    return records, len(kept)
