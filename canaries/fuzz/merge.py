"""`canary fuzz --merge DIR... --report-dir OUT`: the shards of one campaign as one report.

Each shard's report dir (a campaign's: `findings.json`, `fuzz.jsonl`, `findings/`) is read; the
findings are unioned by signature (seen counts added, the first shard's scenario file kept, the
other shards that found it named), the run lines concatenated with their shard, and OUT gets
the same files a campaign writes, so a merged report reads like one campaign's.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

from canaries.fuzz.campaign import Finding, FuzzResult, _write_reports

__all__ = ["MergeError", "merge_reports"]


class MergeError(ValueError):
    """A shard's report dir that cannot be merged (missing or malformed file, named)."""


def _summary(directory: Path) -> dict:
    path = directory / "findings.json"
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except OSError:
        raise MergeError(f"{path}: no such file (is {directory} a canary fuzz report dir?)") from None
    except ValueError as exc:
        raise MergeError(f"{path}: not JSON: {exc}") from None
    for key in ("seed", "runs", "outcomes", "findings"):
        if key not in summary:
            raise MergeError(f"{path}: no {key!r}")
    return summary


def merge_reports(directories: list[Path], out: Path) -> FuzzResult:
    """Union the campaigns in `directories` into `out`; the merged result."""
    if not directories:
        raise MergeError("--merge needs at least one report dir")
    summaries = [(d, _summary(d)) for d in directories]
    seeds = {s["seed"] for _, s in summaries}
    if len(seeds) > 1:
        raise MergeError(f"--merge: the shards ran different seeds ({sorted(seeds)}): not one campaign")
    (out / "findings").mkdir(parents=True, exist_ok=True)
    first = summaries[0][1]
    result = FuzzResult(first["seed"], out, jobs=first.get("jobs", 1), steer=first.get("steer", "off"),
                        shard=f"merged {len(summaries)}", merged_from=[str(d) for d, _ in summaries])
    with open(out / "fuzz.jsonl", "w", encoding="utf-8") as log:
        for directory, summary in summaries:
            result.runs += summary["runs"]
            result.outcomes.update(Counter(summary["outcomes"]))
            result.wall_s = max(result.wall_s, summary.get("wall_s", 0.0))
            result.generate_s = max(result.generate_s, summary.get("generate_s", 0.0))
            result.interrupted = result.interrupted or summary.get("interrupted", False)
            result.features = max(result.features, summary.get("features", 0))
            _merge_findings(result, directory, summary, out)
            lines = directory / "fuzz.jsonl"
            if lines.is_file():
                for line in lines.read_text(encoding="utf-8").splitlines():
                    if line.strip():
                        log.write(json.dumps({**json.loads(line), "shard": summary.get("shard", "?")}) + "\n")
    result.jobs *= len(summaries)  # CPU time in the summary counts every shard's jobs
    _write_reports(result)
    return result


def _merge_findings(result: FuzzResult, directory: Path, summary: dict, out: Path) -> None:
    for raw in summary["findings"]:
        try:
            signature = raw["signature"]
            known = result.findings.get(signature)
            if known is not None:
                known.seen += raw.get("seen", 1)
                continue
            source = directory / "findings" / Path(raw["path"]).name
            finding = Finding(signature, raw["outcome"], raw["reason"], raw["first"], "",
                              seen=raw.get("seen", 1), origin=raw.get("origin") or {},
                              shrunk=raw.get("shrunk", False), size_before=raw.get("size_before"),
                              size_after=raw.get("size_after"))
        except KeyError as exc:
            raise MergeError(f"{directory / 'findings.json'}: a finding without {exc}") from None
        finding.path = str(out / "findings" / f"{finding.slug}.yaml")
        if source.is_file():
            shutil.copyfile(source, finding.path)
        result.findings[signature] = finding
