"""`canary shrink SCENARIO`: delta-debug a scenario down to a smaller one with the same verdict
and signature.

The original runs first; its (verdict, signature) is the target. Then, greedily and until no
step helps, each knob is pushed toward small: fewer requests, lower concurrency, shorter prompts
and outputs, a smaller shared prefix, fewer perturbations, and earlier, plainer triggers. A
candidate is kept only if it still validates and still yields exactly the target. Every step
tried is reported. The result is written as a new scenario file whose first line names the
original. Size is `requests x (longest prompt + max_new_tokens)`.
"""

from __future__ import annotations

import copy
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

__all__ = ["ShrinkResult", "ShrinkStep", "Target", "scenario_size", "shrink", "verdict_target"]

Doc = dict[str, Any]


@dataclass(frozen=True)
class ShrinkStep:
    """One candidate tried: what changed, what it gave, whether it was kept."""

    change: str
    verdict: str
    signature: str
    kept: bool
    size: int


@dataclass
class ShrinkResult:
    source: Path
    output: Path | None
    target: tuple[str, str]
    size_before: int
    size_after: int
    steps: list[ShrinkStep] = field(default_factory=list)

    def to_text(self) -> str:
        verdict, signature = self.target
        lines = [f"shrink {self.source}: target {verdict} ({signature})"]
        lines += [f"  [{i:>2}] {s.change}: {s.verdict} -> {'kept' if s.kept else 'rejected'} (size {s.size})"
                  for i, s in enumerate(self.steps, 1)]
        ratio = self.size_after / self.size_before if self.size_before else 1.0
        lines.append(f"size {self.size_before} -> {self.size_after} ({ratio:.0%}) in {len(self.steps)} "
                     f"step(s); wrote {self.output}")
        return "\n".join(lines)


def scenario_size(scenario: Any) -> int:
    """requests x (longest prompt + max_new_tokens)."""
    w = scenario.workload
    longest = w.prompt_tokens if isinstance(w.prompt_tokens, int) else max(w.prompt_tokens)
    return w.requests * (int(longest) + w.max_new_tokens)


def _workload(doc: Doc, scenario: Any) -> Doc:
    """The doc's workload, filled with the loaded scenario's values (defaults made explicit)."""
    w = scenario.workload
    filled = {"requests": w.requests, "concurrency": w.concurrency,
              "prompt_tokens": w.prompt_tokens if isinstance(w.prompt_tokens, int) else list(w.prompt_tokens),
              "max_new_tokens": w.max_new_tokens}
    return {**filled, **(doc.get("workload") or {})}


def _candidates(doc: Doc) -> Iterator[tuple[str, Callable[[Doc], None]]]:
    """(description, edit) pairs, most reducing first; each edit changes a copy in place."""
    w = doc["workload"]

    def setter(key: str, value: Any) -> Callable[[Doc], None]:
        def edit(d: Doc) -> None:
            d["workload"][key] = value
        return edit

    for key in ("requests", "max_new_tokens", "concurrency", "shared_prefix_tokens"):
        value = w.get(key)
        if isinstance(value, int) and value > 1:
            for smaller in sorted({value // 2, value - 1, 1}):
                if 0 < smaller < value:
                    yield f"workload.{key} {value} -> {smaller}", setter(key, smaller)
    prompt = w.get("prompt_tokens")
    if isinstance(prompt, list) and len(prompt) == 2:
        lo, hi = sorted(int(v) for v in prompt)
        if hi > lo:
            mid = (lo + hi) // 2
            yield f"workload.prompt_tokens [{lo}, {hi}] -> [{lo}, {mid}]", setter("prompt_tokens", [lo, mid])
        if lo > 1:
            yield f"workload.prompt_tokens [{lo}, {hi}] -> [{lo // 2}, {hi}]", \
                setter("prompt_tokens", [max(1, lo // 2), hi])
    elif isinstance(prompt, int) and prompt > 1:
        yield f"workload.prompt_tokens {prompt} -> {prompt // 2}", setter("prompt_tokens", prompt // 2)
    extras = w.get("extra_requests") or []
    for i in reversed(range(len(extras))):
        def drop_extra(d: Doc, i: int = i) -> None:
            del d["workload"]["extra_requests"][i]
            if not d["workload"]["extra_requests"]:
                del d["workload"]["extra_requests"]
        yield f"drop workload.extra_requests[{i}]", drop_extra
    perturbations = doc.get("perturbations") or []
    if len(perturbations) > 1:
        for i in range(len(perturbations)):
            def drop(d: Doc, i: int = i) -> None:
                del d["perturbations"][i]
            yield f"drop perturbations[{i}] ({perturbations[i].get('kind')})", drop
    for i, p in enumerate(perturbations):
        trigger = p.get("trigger") or {}
        for key, floor in (("times", 1), ("interval", 1), ("warmup_steps", 0), ("after_step", 0),
                           ("at_step", 1)):
            value = trigger.get(key)
            if isinstance(value, int) and value > floor:
                for smaller in sorted({floor, value // 2}):
                    if floor <= smaller < value:
                        def edit(d: Doc, i: int = i, key: str = key, smaller: int = smaller) -> None:
                            d["perturbations"][i].setdefault("trigger", {})[key] = smaller
                        yield f"perturbations[{i}].trigger.{key} {value} -> {smaller}", edit


Target = Callable[[Any, Any, Path], tuple[str, str]]


def verdict_target(scenario: Any, record: Any, run_dir: Path) -> tuple[str, str]:
    """What `canary shrink` keeps by default: the verdict and its signature."""
    return record.verdict, record.signature


def shrink(source: str | Path, output: str | Path | None = None, *, runtime: str = "local",
           work_dir: str | Path | None = None, max_steps: int = 60,
           progress: Callable[[ShrinkStep], None] | None = None,
           target_of: Target = verdict_target, name: str | None = None,
           header: str | None = None, engine_root: str | Path | None = None,
           device: str | None = None, memory: str | None = None,
           engine_python: str | None = None) -> ShrinkResult:
    """Shrink the scenario file `source`; writes the result (default `<name>-shrunk.yaml`
    beside it) and returns what was tried.

    `target_of(scenario, record, run_dir)` says what a run must keep to count as the same
    (default: verdict and signature; `canary fuzz` keeps its oracle's outcome and signature).
    `name` names the result (default `<name>-shrunk`); `header` replaces its first comment line;
    `engine_root` runs another engine's sources (a mutant); `device` overrides engine.device;
    `memory` and `engine_python` run another memory path (e.g. an SGLang release's)."""
    from canaries.runner import run_scenario
    from canaries.scenario import ScenarioError, load_scenario

    source = Path(source)
    work = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="canary-shrink-"))
    work.mkdir(parents=True, exist_ok=True)
    from canaries.scenario.yamldoc import read_doc

    original = load_scenario(source)
    # The scenario format's own reading (`off` stays the string it means there), then plain YAML
    # out: yaml.safe_dump quotes whatever would read back as another type.
    doc: Doc = copy.deepcopy(read_doc(source).data)
    doc["workload"] = _workload(doc, original)
    doc["name"] = name or f"{original.name}-shrunk"
    counter = iter(range(10**6))

    def attempt(candidate: Doc) -> tuple[Any, tuple[str, str]]:
        n = next(counter)
        path = work / f"try-{n:03d}.yaml"
        path.write_text(yaml.safe_dump(candidate, sort_keys=False), encoding="utf-8")
        scenario = load_scenario(path)
        run_dir = work / f"run-{n:03d}"
        record = run_scenario(scenario, run_dir, runtime=runtime, device=device, engine_root=engine_root,
                              memory=memory, engine_python=engine_python)
        return scenario, target_of(scenario, record, run_dir)

    first, target = attempt(doc)
    result = ShrinkResult(source, None, target, scenario_size(original), scenario_size(first))
    best, best_size = doc, scenario_size(first)
    improved = True
    while improved and len(result.steps) < max_steps:
        improved = False
        for change, edit in _candidates(best):
            if len(result.steps) >= max_steps:
                break
            candidate = copy.deepcopy(best)
            edit(candidate)
            try:
                scenario, got = attempt(candidate)
            except ScenarioError as exc:
                step = ShrinkStep(change, "INVALID", str(exc).splitlines()[0], False, best_size)
            else:
                size = scenario_size(scenario)
                kept = got == target and size <= best_size
                step = ShrinkStep(change, got[0], got[1], kept, size)
                if kept:
                    best, best_size = candidate, size
            result.steps.append(step)
            if progress is not None:
                progress(step)
            if step.kept:
                improved = True
                break  # restart from the smaller scenario: its candidates differ
    out = Path(output) if output else source.with_name(f"{original.name}-shrunk.yaml")
    header = header or (f"shrunk by `canary shrink` from {source} (size {result.size_before} -> "
                        f"{best_size}, same verdict {target[0]} and signature {target[1]})")
    comment = "".join(f"# {line}\n" for line in header.splitlines())
    out.write_text(comment + yaml.safe_dump(best, sort_keys=False), encoding="utf-8")
    load_scenario(out)  # what we wrote must load
    result.output, result.size_after = out, best_size
    return result
