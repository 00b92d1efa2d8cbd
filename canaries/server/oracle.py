"""The output oracle of the sglang-server runtime: the same server's unperturbed answers.

Our engine's oracle recomputes each answer with the engine's own model; SGLang's model is its
own, so the reference is SGLang's server itself, clean (the scenario's engine section, no
perturbation), given the same requests. A clean answer is computed once per engine section and
plan and kept on disk (`<report dir>/.server-oracle/<key>.json`), so a library run pays one clean
server per configuration, not one per scenario.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["CleanServerFailed", "ServerOracle", "mismatches"]


class CleanServerFailed(RuntimeError):
    """The clean server answered a planned request with an HTTP error: the release's own
    behaviour (no reference answer), not a failure of the harness."""


def mismatches(reference: dict[str, list[int]], responses: Sequence[dict]) -> list[dict]:
    """Answers that differ from the clean server's for the same rid (a failed request is the
    verdict's business, not the oracle's)."""
    found = []
    for response in responses:
        got, want = response.get("output_ids"), reference.get(response["rid"])
        if got is None or want is None:
            continue
        got = list(got)
        if got != want:
            first = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
                         min(len(got), len(want)))
            found.append({"rid": response["rid"], "first_diff": first, "expected": want, "got": got})
    return found


class ServerOracle:
    """Clean answers of SGLang's server for one engine section and plan, computed at most once."""

    def __init__(self, cache_dir: Path, engine: dict[str, Any], plan: Sequence[Any], release: str) -> None:
        key_source = json.dumps({"engine": engine, "release": release,
                                 "plan": [[p.rid, list(p.prompt), p.max_new_tokens] for p in plan]},
                                sort_keys=True, default=str)
        self.key = hashlib.sha256(key_source.encode()).hexdigest()[:16]
        self.path = Path(cache_dir) / f"{self.key}.json"

    def reference(self, compute: Callable[[], list[dict]]) -> dict[str, list[int]]:
        """The clean answers by rid: from the cache, else `compute()` (a clean run's responses)."""
        if self.path.is_file():
            return {rid: list(ids) for rid, ids in json.loads(self.path.read_text(encoding="utf-8")).items()}
        responses = compute()
        # A request planned to fail (a 400) or to be hung up on has no answer to hold others to.
        failed = [r for r in responses if r.get("output_ids") is None and r.get("expect_status", 200) == 200]
        answered = [r for r in failed if r.get("status") is not None and not r.get("hang")]
        if answered:
            first = answered[0]
            raise CleanServerFailed(f"the release's own clean server answered "
                                    f"{', '.join(r['rid'] for r in answered[:5])} with HTTP {first['status']} "
                                    f"({str(first.get('error') or '')[:300]})")
        if failed:
            raise RuntimeError(f"the clean server did not answer {', '.join(r['rid'] for r in failed[:5])} "
                               f"({failed[0].get('error') or failed[0].get('status')}): no oracle")
        answers = {r["rid"]: list(r["output_ids"]) for r in responses if r.get("output_ids") is not None}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(answers), encoding="utf-8")
        tmp.replace(self.path)
        return answers
