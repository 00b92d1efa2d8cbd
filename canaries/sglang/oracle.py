"""The answer oracle of the sglang-server runtime: answers that do not come from the code under
test.

Our engine's oracle recomputes each answer with the engine's own model; SGLang's model is its
own, so the reference is an SGLang server given the same requests. Which one is a
`ServerReference`, and every verdict records it:

- `plain(python)`: the release's own server with nothing of the memory path under test in play:
  no radix cache (no cache reuse), no window eviction (its interval past the context length, the
  SWA pool as large as the full pool), one request at a time, no checks. A release judged alone
  (`canary run`, a matrix column that is no candidate) is held to it: a bug in its cache reuse,
  eviction, batching or frees is not in the answers it is held to.
- `release(python, label)`: another release's clean server with the scenario's own engine
  section: a gate's candidate is held to the `--last` release's answers.

Either is computed once per engine section, plan and reference and kept on disk
(`<key>.json`), so a library run pays one reference server per configuration, not one per
scenario: across runs under `$CANARY_CACHE_DIR/server-oracle/` where the reference's install and
the suite's code have a fingerprint (canaries/sglang/oracle_cache.py), else in the report
(`<report dir>/.server-oracle/`). Greedy answers only (a sampled one has no reference).

`ServerAnswerOracle` runs it for one scenario: for a clean control on a thread from the run's
start (its verdict needs it), for a perturbed one after the run and only where the run was silent
(no detector fired, the engine did not die): there an answer that differs says the damage was
read, which nothing else on the server can say.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["CleanServerFailed", "ServerAnswerOracle", "ServerOracle", "ServerReference", "answer_mismatches",
           "clean_answers", "mismatches"]

# Past any context length the suite configures: a plain reference never slides a window.
_NO_EVICTION_INTERVAL = 1 << 20


@dataclass(frozen=True)
class ServerReference:
    """Whose clean answers judge a run on SGLang's server.

    Args:
        python: the reference server's interpreter (a server venv's, or a patched copy's).
        label: what it is, for the record (`0.5.23`, `0.5.23+PATCH`).
        plain: the scenario's engine section made plain (see the module docstring), else as is.
    """

    python: str
    label: str
    plain: bool

    def __post_init__(self) -> None:
        if not self.python or not self.label:
            raise ValueError("a server reference needs an interpreter and a label")

    @classmethod
    def of_release(cls, python: str, label: str) -> ServerReference:
        """The release's own server, plain: the reference of a release judged alone."""
        return cls(str(python), label, plain=True)

    @classmethod
    def default(cls, python: str | None = None) -> ServerReference:
        """The plain server of the release `python` runs (default: the server venv's, 0.5.23)."""
        from canaries.sglang.releases.venvs import find_python, installed_version

        python = python or str(find_python("0.5.23", server=True) or "")
        if not python:
            raise RuntimeError("no venv runs SGLang's server here: bash scripts/make-sglang-venv.sh --server")
        return cls.of_release(python, installed_version(Path(python)) or "?")

    def describe(self) -> str:
        how = ("plain: no radix cache, no window eviction, one request at a time" if self.plain
               else "the scenario's own engine section")
        return f"SGLang {self.label}'s clean server ({how})"

    def engine(self, engine: dict[str, Any]) -> dict[str, Any]:
        """The engine section the reference server runs, from the scenario's."""
        if not self.plain:
            return dict(engine)
        from engine_stub.config import EngineConfig

        full = int(engine.get("full_pool_tokens", EngineConfig.full_pool_tokens))
        return {**engine, "radix_cache": False, "swa_pool_tokens": full, "max_running_requests": 1,
                "kv_canary": "off", "invariant_check": "off", "strict_mem_check_during_idle": False}

    def env(self) -> dict[str, str]:
        """What the reference server's launch adds (a plain one never evicts)."""
        return {"SGLANG_SWA_EVICTION_INTERVAL": str(_NO_EVICTION_INTERVAL)} if self.plain else {}

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "python": self.python, "plain": self.plain, "describe": self.describe()}


class CleanServerFailed(RuntimeError):
    """The clean server answered a planned request with an HTTP error: the release's own
    behaviour (no reference answer), not a failure of the harness."""


def mismatches(reference: dict[str, list[int]], responses: Sequence[dict]) -> list[dict]:
    """Answers that differ from the reference's for the same rid (a failed request is the
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


# One lock per answers file: held while its answers are computed.
_COMPUTING: dict[Path, threading.Lock] = {}
_COMPUTING_LOCK = threading.Lock()


class ServerOracle:
    """Clean answers of one reference server for one engine section and plan, computed at most
    once (cached on disk)."""

    def __init__(self, cache_dir: Path, engine: dict[str, Any], plan: Sequence[Any], reference: str) -> None:
        key_source = json.dumps({"engine": engine, "reference": reference,
                                 "plan": [[p.rid, list(p.prompt), p.max_new_tokens] for p in plan]},
                                sort_keys=True, default=str)
        self.key = hashlib.sha256(key_source.encode()).hexdigest()[:16]
        self.path = Path(cache_dir) / f"{self.key}.json"

    def reference(self, compute: Callable[[], list[dict]]) -> dict[str, list[int]]:
        """The clean answers by rid: from the cache, else `compute()` (a clean run's responses).
        Two scenarios of a run that need the same answers at once (two controls side by side)
        get one computation: the second waits for the first's."""
        with _COMPUTING_LOCK:
            computing = _COMPUTING.setdefault(self.path, threading.Lock())
        with computing:
            return self._reference(compute)

    def _reference(self, compute: Callable[[], list[dict]]) -> dict[str, list[int]]:
        if self.path.is_file():
            return {rid: list(ids) for rid, ids in json.loads(self.path.read_text(encoding="utf-8")).items()}
        responses = compute()
        # A request planned to fail (a 400) or to be hung up on has no answer to hold others to.
        failed = [r for r in responses if r.get("output_ids") is None and r.get("expect_status", 200) == 200]
        answered = [r for r in failed if r.get("status") is not None and not r.get("hang")]
        if answered:
            first = answered[0]
            raise CleanServerFailed(f"the reference server (the release's own) answered "
                                    f"{', '.join(r['rid'] for r in answered[:5])} with HTTP {first['status']} "
                                    f"({str(first.get('error') or '')[:300]})")
        if failed:
            raise RuntimeError(f"the reference server did not answer {', '.join(r['rid'] for r in failed[:5])} "
                               f"({failed[0].get('error') or failed[0].get('status')}): no oracle")
        answers = {r["rid"]: list(r["output_ids"]) for r in responses if r.get("output_ids") is not None}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".tmp{threading.get_ident()}")
        tmp.write_text(json.dumps(answers), encoding="utf-8")
        tmp.replace(self.path)
        return answers


def clean_answers(reference: ServerReference, spec: dict, plan: list[Any], run_dir: Path, workload: Any,
                  seed: int, patience: Any) -> dict[str, list[int]]:
    """`reference`'s clean answers (by rid) to `plan` for `spec`'s engine section, cached
    (`oracle_cache.kept_dir`; RuntimeError if the reference server did not answer)."""
    from canaries.driver import drive
    from canaries.runner import cancelled
    from canaries.sglang.oracle_cache import kept_dir
    from canaries.sglang.runtime import READY_TIMEOUT_S, SGLangServerRuntime

    clean_spec = {**spec, "engine": reference.engine(spec.get("engine") or {}), "perturbations": []}
    cache = ServerOracle(kept_dir(reference.python, run_dir.parent), clean_spec["engine"], plan, reference.describe()
                         + f" [{reference.python}]")

    def clean_run() -> list[dict]:
        clean_dir = run_dir / "oracle"
        clean_dir.mkdir(parents=True, exist_ok=True)
        clean_path = clean_dir / "spec.json"
        clean_path.write_text(json.dumps(clean_spec, indent=2, default=str) + "\n", encoding="utf-8")
        clean = SGLangServerRuntime(ready_timeout=READY_TIMEOUT_S, python=reference.python,
                                    extra_env=reference.env())
        if cancelled():
            raise RuntimeError("the run was interrupted before the reference server started")
        try:
            return drive(clean.start(clean_path, clean_dir), workload, seed, patience, plan=plan,
                         progress=clean.progress, hang_up_by=clean.hang_up_by, lockstep=clean.lockstep)
        finally:
            clean.stop()

    return cache.reference(clean_run)


def answer_mismatches(spec: dict, plan: list[Any], run_dir: Path, workload: Any, seed: int, patience: Any,
                      responses: list[dict], reference: ServerReference | None = None) -> tuple[list[dict], str | None]:
    """`responses` (a run on SGLang's server) against `reference`'s clean answers (default: the
    server venv's release, plain): (mismatches, error)."""
    try:
        reference = reference or ServerReference.default()
        return mismatches(clean_answers(reference, spec, plan, run_dir, workload, seed, patience), responses), None
    except Exception as exc:  # noqa: BLE001 - an oracle failure must not pass silently
        return [], f"the reference's answers failed: {type(exc).__name__}: {exc}"


class ServerAnswerOracle:
    """One scenario's answers held to a `ServerReference` (see the module docstring): a control's
    reference computed on a thread from the run's start, a perturbed run's after it, if silent."""

    def __init__(self, scenario: Any, spec: dict, plan: list[Any], run_dir: Path, patience: Any,
                 reference: ServerReference) -> None:
        self._args = (reference, spec, plan, run_dir, scenario.workload, scenario.seed, patience)
        self._run_dir = run_dir
        self.reference = reference
        greedy = scenario.workload.temperature == 0
        self._control = scenario.expect.clean and greedy
        self._perturbed = bool(scenario.perturbations) and greedy
        self._answers: dict[str, list[int]] | None = None
        self._mismatches: list[dict] = []
        self._error: str | None = None
        # The reference server answered the plan with an HTTP error (CleanServerFailed): no
        # reference, and the release's behaviour, not a harness failure.
        self.no_oracle: str | None = None
        self._judged = False
        self._responses: list[dict] | None = None  # the run's, until judged
        self._thread: threading.Thread | None = None
        if self._control:
            self._thread = threading.Thread(target=self._compute, daemon=True, name="canary-server-oracle")
            self._thread.start()

    def _compute(self) -> None:
        try:
            self._answers = clean_answers(*self._args)
        except CleanServerFailed as exc:
            self.no_oracle = str(exc)
        except Exception as exc:  # noqa: BLE001 - an oracle failure must not pass silently
            self._error = f"the reference's answers failed: {type(exc).__name__}: {exc}"

    def start(self, responses: list[dict]) -> None:
        """Hold `responses` (the run's) to the reference, where the verdict rests on silence: once
        the server has stopped (`result`), since its last idle pass may still fire a detector,
        and a silent perturbed run's reference server then runs beside no other of this job's."""
        self._responses = responses

    def _judge(self) -> None:
        from canaries.verdict.record import detector_of
        from engine_stub.events import read_events

        responses, self._responses = self._responses, None
        if self._thread is not None:
            self._thread.join()
        if responses is None or not (self._control or self._perturbed) or not responses:
            return
        try:
            events = read_events(self._run_dir / "events.jsonl")
        except (OSError, ValueError):
            events = []
        if any(detector_of(e) is not None or e.get("kind") == "crash" for e in events):
            self._error = self.no_oracle = None  # a detector fired or the engine died: the verdict rests on that
            return
        if self._perturbed and not self._control:
            self._compute()
        if self._answers is not None:
            self._judged = True
            self._mismatches = mismatches(self._answers, responses)

    def result(self) -> tuple[list[dict], str | None]:
        """(mismatches, error) of a control: its verdict's; a perturbed run's are `evidence`.
        Called once the server has stopped."""
        self._judge()
        if self._thread is not None:
            self._thread.join()  # a run that ended early still leaves no reference server behind
        if not self._control:
            return [], None
        return self._mismatches, self._error

    def record(self) -> dict[str, Any] | None:
        """What a verdict records of the oracle: the reference, whether it judged, and for a
        perturbed run the answers that differed (the damage was read), or its failure."""
        if not self._judged and self._error is None and self.no_oracle is None:
            return None
        out: dict[str, Any] = {"reference": self.reference.to_dict(), "judged": self._judged}
        if self._perturbed and not self._control:
            out["differs"] = [{k: m[k] for k in ("rid", "first_diff")} for m in self._mismatches]
        if self._error is not None:
            out["error"] = self._error
        if self.no_oracle is not None:
            out["no_oracle"] = self.no_oracle
        return out
