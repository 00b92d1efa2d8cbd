"""Loading: scenario YAML -> a validated Scenario, every problem named by file, line and field.

The field tables (fields.py) check each field; this module adds what spans fields: the engine
config (profile knobs under the scenario's, built into one EngineConfig: the suite's only
validation of it, before the engine's own at its process boundary), expect's modes, the
disabled knobs in force, the workload fitting the engine. Validation collects every problem it
can find; it never stops at the first. It also warns (never fails) where a scenario is valid but
cannot do what it says: a `target.request` index no running set of the workload reaches, a
request it must have served that the engine would refuse (a 400 at submit: the run would end
INCONCLUSIVE), a request planned as refused that the engine would serve.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from canaries.scenario.fields import (
    DEFAULT_PROFILE,
    DISABLED,
    ENGINE,
    EXPECT,
    SCENARIO,
    SCENARIO_DIR,
    WORKLOAD,
    engine_knobs,
    profile_paths,
)
from canaries.scenario.model import (
    Disabled,
    Expect,
    ExtraRequest,
    Problem,
    Scenario,
    ScenarioError,
    Workload,
)
from canaries.scenario.yamldoc import Doc, read_doc
from engine_stub.admission import refusal
from engine_stub.config import ConfigError, EngineConfig, coerce_knob, config_from_sources
from engine_stub.fields import INVALID

__all__ = ["check_paths", "discover", "engine_spec", "list_profiles", "load_paths",
           "load_scenario", "validate_paths"]


# ---- profiles (each file read once per process, while it is unchanged) ---------------------------

_PROFILE_DOCS: dict[Path, tuple[tuple[int, int], Doc]] = {}


def _profile_doc(path: Path) -> Doc:
    try:
        stat = path.stat()
        stamp = (stat.st_mtime_ns, stat.st_size)
    except OSError:
        return read_doc(path)
    cached = _PROFILE_DOCS.get(path)
    if cached is None or cached[0] != stamp:
        doc = read_doc(path)
        if doc.data is not None and not isinstance(doc.data, dict):
            doc.add("", "a profile must be a mapping of engine knobs")
        elif isinstance(doc.data, dict):
            # Only the keys: the values are checked with the scenario's, in one EngineConfig.
            ENGINE.check_keys({k: v for k, v in doc.data.items() if k != "profile"}, "",
                              doc.add)
            if "profile" in doc.data:
                doc.add("profile", "a profile cannot name another profile", key=True)
        cached = _PROFILE_DOCS[path] = (stamp, doc)
    return cached[1]


def list_profiles() -> dict[str, dict]:
    """Every engine profile in configs/engines, by name, as written (knob -> value)."""
    out = {}
    for name, path in profile_paths().items():
        data = _profile_doc(path).data
        out[name] = dict(data) if isinstance(data, dict) else {}
    return out


# ---- the engine ----------------------------------------------------------------------------------


def _config_error_knob(exc: ConfigError) -> str | None:
    text = str(exc)
    m = re.match(r"^([a-z_]+)=", text) or re.match(r"^unknown engine knob '([a-z_]+)'", text)
    return m.group(1) if m else None


def _engine(doc: Doc, raw: Any, seed: int) -> tuple[str, EngineConfig | None]:
    """The profile name and the EngineConfig (None if any knob is bad, each reported where it
    was written: the scenario's engine section, or the profile file)."""
    section = ENGINE.parse(raw, "engine", doc.add)
    if section is INVALID:
        return DEFAULT_PROFILE, None
    profile = section.pop("profile", None)
    if profile is None:
        if isinstance(raw, dict) and "profile" in raw:  # given, and reported as unknown
            return str(raw["profile"]), None
        profile = DEFAULT_PROFILE
    pdoc = _profile_doc(profile_paths()[profile])
    doc.problems.extend(pdoc.problems)
    if pdoc.problems:
        return profile, None
    knobs = engine_knobs()
    from_profile = {k: v for k, v in (pdoc.data or {}).items() if k in knobs}
    values = {**from_profile, **section, "seed": seed}
    source = f"{doc.file}: engine"

    def report(knob: str | None, message: str) -> None:
        # Where the fix goes: a knob the scenario sets (the culprit, else the first the message
        # names), else the profile's own line in the profile's file.
        named = [k for k in values if re.search(rf"\b{re.escape(k)}=", message)]
        mine = [k for k in ([knob] if knob in section else []) + named if k in section]
        if mine:
            doc.add(f"engine.{mine[0]}", message)
        elif knob in from_profile:
            doc.problems.append(Problem(pdoc.file, pdoc.line(knob), knob, message))
        else:
            doc.add("engine", message)

    # A bad knob is reported and dropped (the default stands in) so later ones are checked too.
    bad = False
    for _ in range(len(values) + 2):
        try:
            config = config_from_sources(environ={}, overrides=values, overrides_source=source)
        except ConfigError as exc:
            bad = True
            knob = _config_error_knob(exc)
            report(knob, str(exc))
            if knob in values and knob != "seed":
                del values[knob]
                continue
            return profile, None
        return profile, None if bad else config
    return profile, None


# ---- workload, expect ----------------------------------------------------------------------------


Spans = tuple[tuple[int, int], ...]  # (shortest, longest) prompt of each request, in rid order


def _workload(doc: Doc, raw: Any, engine: EngineConfig | None) -> tuple[Workload, Spans]:
    """The workload, and the prompt spans of its requests (as the driver builds the prompts)."""
    values = WORKLOAD.parse(raw, "workload", doc.add)
    if values is INVALID:
        return Workload(), ()
    extras = values.pop("extra_requests", ())
    w = dataclasses.replace(Workload(), **values)
    if "shared_prefix_tokens" in values and w.shared_prefix_tokens >= w.prompt_tokens[0]:
        doc.add("workload.shared_prefix_tokens",
                f"must be below the shortest prompt ({w.prompt_tokens[0]}), got "
                f"{w.shared_prefix_tokens}")
    if engine is not None and w.prompt_tokens[1] + w.max_new_tokens > engine.max_context_len:
        field_ = "workload.max_new_tokens" if "max_new_tokens" in values else "workload.prompt_tokens"
        doc.add(field_, f"longest prompt ({w.prompt_tokens[1]}) + max_new_tokens "
                        f"({w.max_new_tokens}) exceeds the engine's "
                        f"max_context_len={engine.max_context_len}")
    extras, spans = _extra_requests(doc, extras, w, engine)
    return dataclasses.replace(w, extra_requests=extras), spans


def _extra_requests(doc: Doc, items: tuple[dict, ...], w: Workload,
                    engine: EngineConfig | None) -> tuple[tuple[ExtraRequest, ...], Spans]:
    """The explicit requests, each checked against the ones before it: `prompt_of` names an
    earlier request (one that is served, for `with_answer`), `keep_tokens` fits the shortest
    prompt (and answer) that request can have, and a request that must be served fits the
    engine's context. Also the prompt spans of every request (generated ones first), or () once
    a problem is found."""
    lo, hi = w.prompt_tokens
    shared = w.shared_prefix_tokens
    # (shortest, longest) prompt of each request so far, in rid order.
    spans = [(max(lo, shared + 1), max(hi, shared + 1))] * w.requests
    answers = [w.max_new_tokens] * w.requests  # the answer's length, 0 for a planned refusal
    out: list[ExtraRequest] = []
    for j, item in enumerate(items):
        where = f"workload.extra_requests[{j}]"
        index = w.requests + j
        extra = ExtraRequest(**item)
        if extra.prompt_of is not None:
            if extra.prompt_of >= index:
                doc.add(f"{where}.prompt_of", f"must name an earlier request (below {index}), got "
                                              f"{extra.prompt_of}")
                return (), ()
            shortest, longest = spans[extra.prompt_of]
            if extra.with_answer:
                if not answers[extra.prompt_of]:
                    doc.add(f"{where}.with_answer", f"request {extra.prompt_of} is planned to be "
                                                    "refused or hung up on: it has no answer to follow")
                    return (), ()
                shortest += answers[extra.prompt_of]
                longest += answers[extra.prompt_of]
            if extra.keep_tokens is not None:
                if extra.keep_tokens > shortest:
                    what = "prompt and answer" if extra.with_answer else "prompt"
                    doc.add(f"{where}.keep_tokens", f"request {extra.prompt_of}'s {what} may be "
                                                    f"only {shortest} tokens long, got {extra.keep_tokens}")
                    return (), ()
                shortest = longest = extra.keep_tokens
        else:
            assert extra.prompt_tokens is not None
            if extra.prompt_tokens <= shared:
                doc.add(f"{where}.prompt_tokens", f"must exceed shared_prefix_tokens ({shared}), got "
                                                  f"{extra.prompt_tokens}")
                return (), ()
            shortest = longest = extra.prompt_tokens
        span = (shortest + extra.append_tokens, longest + extra.append_tokens)
        if extra.min_cached_tokens is not None:
            if extra.status != 200 or (engine is not None and not engine.radix_cache):
                doc.add(f"{where}.min_cached_tokens", "needs a served request (status 200) and "
                                                      "radix_cache: true")
                return (), ()
            if extra.min_cached_tokens >= span[0]:
                doc.add(f"{where}.min_cached_tokens", f"must be below the prompt's length "
                                                      f"({span[0]}: one token is always computed), "
                                                      f"got {extra.min_cached_tokens}")
                return (), ()
        spans.append(span)
        max_new = extra.max_new_tokens or w.max_new_tokens
        if extra.hang_up_after_tokens is not None and (
                extra.status != 200 or extra.hang_up_after_tokens >= max_new):
            doc.add(f"{where}.hang_up_after_tokens",
                    f"needs a served request (status 200) and fewer tokens than its max_new_tokens "
                    f"({max_new}), got {extra.hang_up_after_tokens}")
            return (), ()
        # A hung-up request has no answer for a follow-up to use.
        answers.append(max_new if extra.status == 200 and extra.hang_up_after_tokens is None else 0)
        if engine is not None and extra.status == 200 and span[1] + max_new > engine.max_context_len:
            doc.add(where, f"a prompt of up to {span[1]} tokens + max_new_tokens ({max_new}) "
                           f"exceeds the engine's max_context_len={engine.max_context_len}; "
                           "give status: 400 if the engine must refuse it")
        out.append(extra)
    return tuple(out), tuple(spans)


def _expect(doc: Doc, raw: Any, engine: EngineConfig | None, n_perturbations: int) -> Expect:
    if raw is None:
        doc.add("expect", "missing; give one of clean: true, fires: [...], or disabled: {...} + "
                          "detected_by: [...]")
        return Expect()
    if not isinstance(raw, dict):
        doc.add("expect", f"expected a mapping, got {type(raw).__name__}")
        return Expect()
    modes = [m for m in ("clean", "fires", "disabled")
             if m in raw and not (m == "clean" and raw[m] is False)]
    if len(modes) != 1:
        what = "none" if not modes else " and ".join(modes)
        doc.add("expect", f"needs exactly one of clean: true, fires: [...], disabled: {{...}} "
                          f"(got {what})")
    # within_steps and detected_by mean something only beside their mode.
    parsed = {k: v for k, v in raw.items() if k != "disabled"}
    if "within_steps" in raw and "fires" not in raw:
        doc.add("expect.within_steps", "only meaningful with fires", key=True)
        parsed.pop("within_steps")
    if "any" in raw and "fires" not in raw:
        doc.add("expect.any", "only meaningful with fires", key=True)
        parsed.pop("any")
    if "detected_by" in raw and "disabled" not in raw:
        doc.add("expect.detected_by", "only meaningful with disabled", key=True)
        parsed.pop("detected_by")
    values = EXPECT.parse(parsed, "expect", doc.add)
    if "disabled" in raw:
        values["disabled"] = _disabled(doc, raw["disabled"], engine)
        if "detected_by" not in raw:
            doc.add("expect.detected_by", "required with disabled: name the detectors that still "
                                          "catch it")
    if values.get("clean"):
        if n_perturbations:
            doc.add("perturbations", "a clean (control) scenario must not have perturbations",
                    key=True)
        for key in ("fires", "any", "silent", "within_steps", "detected_by", "disabled"):
            if key in raw and key not in modes:
                doc.add(f"expect.{key}", "not allowed with clean: true", key=True)
    elif modes and n_perturbations == 0:
        doc.add("perturbations", f"expect.{modes[0]} needs at least one perturbation", key=True)
    for name in set(values.get("silent", ())) & set(values.get("fires", ())):
        doc.add("expect.silent", f"{name!r} is both in fires and in silent")
    return Expect(**values)


def _disabled(doc: Doc, raw: Any, engine: EngineConfig | None) -> Disabled | None:
    path = "expect.disabled"
    if not isinstance(raw, dict):
        doc.add(path, f"expected a mapping of engine knobs plus reason, got {type(raw).__name__}")
        return None
    DISABLED.check_keys(raw, path, doc.add)  # the values: the reason below, the knobs after it
    reason = raw.get("reason")
    if not isinstance(reason, str) or not reason.strip():
        doc.add(f"{path}.reason", "required: a non-empty string saying why the check is off")
        reason = ""
    declared = [k for k in raw if k in engine_knobs()]
    if not declared:
        doc.add(path, "name at least one engine knob that is disabled (e.g. invariant_check: off)")
    checks: dict[str, object] = {}
    # Each declared value, spelled as the engine would read it, must be what the scenario's
    # engine resolves to (unchecked if the engine is invalid: its problems are reported).
    for knob in declared:
        try:
            value = coerce_knob(knob, raw[knob], f"{doc.file}: {path}")
        except ConfigError as exc:
            doc.add(f"{path}.{knob}", str(exc))
            continue
        checks[knob] = value
        if engine is not None and getattr(engine, knob) != value:
            doc.add(f"{path}.{knob}",
                    f"declares {knob}={value!r} but the scenario's engine resolves to "
                    f"{knob}={getattr(engine, knob)!r}; set engine.{knob}: {raw[knob]} as well")
    return Disabled(checks=checks, reason=reason)


# ---- warnings ------------------------------------------------------------------------------------


def _warnings(doc: Doc, data: dict, s: Scenario, spans: Spans) -> tuple[Problem, ...]:
    """Valid, yet it cannot do what it says: a request index no running set reaches, or a
    request the engine would not answer as planned (`_refusals`).

    A target's request index counts among the running requests in rid order; at most
    min(workload.concurrency, workload.requests, engine.max_running_requests) run at once.
    """
    w, cfg = s.workload, s.engine
    limits = {"workload.concurrency": w.concurrency, "workload.requests": w.requests,
              "engine max_running_requests": cfg.max_running_requests}
    binding, most = min(limits.items(), key=lambda kv: kv[1])
    out = []
    for i, spec in enumerate(s.perturbations):
        index = spec.target.request
        if isinstance(index, int) and index >= most:
            target = (data["perturbations"][i] or {}).get("target") or {}
            key = "index" if "index" in target and "request" not in target else "request"
            path = f"perturbations[{i}].target.{key}"
            out.append(Problem(doc.file, doc.line(path), path,
                               f"request {index} can never be picked: requests are picked among "
                               f"the running ones in rid order, and at most {most} run at once "
                               f"({binding} {most}); use an index below {most}",
                               warning=True))
    return tuple(out) + _refusals(doc, s, spans)


def _refusals(doc: Doc, s: Scenario, spans: Spans) -> tuple[Problem, ...]:
    """Requests the engine would not answer as planned: one it must serve that it would refuse
    at submit (`admission.refusal`, the engine's own rule: a 400, and the run INCONCLUSIVE), or
    one planned as refused that it would serve.

    A refusal only grows with the prompt and with max_new_tokens, so the longest prompt a
    request can have decides whether it may be refused, and the shortest whether it may be
    served. The generated requests share max_new_tokens: one warning covers them all.
    """
    w, cfg = s.workload, s.engine
    out: list[Problem] = []

    def warn(path: str, message: str) -> None:
        out.append(Problem(doc.file, doc.line(path), path, message, warning=True))

    if not spans:  # pragma: no cover - spans are missing only when a problem was reported
        return ()
    longest = max(hi for _, hi in spans[:w.requests])
    refused = refusal(cfg, longest, w.max_new_tokens)
    if refused is not None:
        message, param = refused
        fields = ["workload.prompt_tokens", "workload.max_new_tokens"]
        if param == "max_new_tokens":
            fields.reverse()
        path = next((f for f in fields if f in doc.key_lines), "workload")
        warn(path, f"requests of up to {longest} prompt tokens would be refused by this engine: "
                   f"{message}")
    for j, extra in enumerate(w.extra_requests):
        where = f"workload.extra_requests[{j}]"
        shortest, longest = spans[w.requests + j]
        max_new = extra.max_new_tokens or w.max_new_tokens
        up_to = f"{longest}" if shortest == longest else f"up to {longest}"
        if extra.status == 200:
            refused = refusal(cfg, longest, max_new)
            if refused is not None:
                hint = ("; give status: 400 if the engine must refuse it"
                        if refusal(cfg, shortest, max_new) is not None else "")
                warn(where, f"a prompt of {up_to} tokens with max_new_tokens {max_new} would be "
                            f"refused by this engine: {refused[0]}{hint}")
        elif refusal(cfg, shortest, max_new) is None:
            as_few = f"{shortest}" if shortest == longest else f"as few as {shortest}"
            warn(f"{where}.status", f"planned as refused (status: 400), but this engine would serve "
                                    f"a prompt of {as_few} tokens with max_new_tokens {max_new}")
    return tuple(out)


# ---- loading -------------------------------------------------------------------------------------


def _load(path: Path) -> tuple[Scenario | None, list[Problem], str | None, int | None]:
    """Scenario (or None), every problem, and the scenario's name and its line (for dup checks)."""
    doc = read_doc(path)
    if doc.problems and doc.data is None:
        return None, doc.problems, None, None
    data = doc.data
    if data is None:
        doc.add("", "empty file; a scenario needs at least name and expect")
        return None, doc.problems, None, None
    if not isinstance(data, dict):
        doc.add("", f"a scenario must be a mapping, got {type(data).__name__}")
        return None, doc.problems, None, None
    SCENARIO.check_keys(data, "", doc.add)

    def top(key: str, default: Any) -> Any:
        if key not in data:
            return default
        value = SCENARIO[key].type.parse(data[key], key, doc.add)
        return default if value is INVALID else value

    if "name" not in data:
        doc.add("name", "required")
    name = top("name", None)
    if data.get("description") is None:  # absent, or written empty
        description = ""
    else:
        description = top("description", None)
        description = str(data["description"]) if description is None else description
    seed = top("seed", SCENARIO["seed"].default)

    profile, engine = _engine(doc, data.get("engine"), seed)
    workload, spans = _workload(doc, data.get("workload"), engine)
    perturbations = SCENARIO["perturbations"].type.parse(data.get("perturbations"),
                                                         "perturbations", doc.add)
    n_pert = len(data["perturbations"]) if isinstance(data.get("perturbations"), list) else 0
    expect = _expect(doc, data.get("expect"), engine, n_pert)
    regressions = top("regressions", ())

    name_line = doc.line("name") if name is not None else None
    doc.problems.sort(key=lambda p: p.line if p.line is not None else 0)
    if doc.problems or engine is None:
        if engine is None and not doc.problems:  # pragma: no cover - every None is reported
            doc.add("engine", "the engine config could not be built")
        return None, doc.problems, name, name_line
    scenario = Scenario(
        name=name, description=description, seed=seed, profile=profile, engine=engine,
        workload=workload, perturbations=perturbations, expect=expect, path=str(path),
        regressions=tuple(regressions), raw=data,
    )
    scenario = dataclasses.replace(scenario, warnings=_warnings(doc, data, scenario, spans))
    return scenario, [], name, name_line


def load_scenario(path: str | os.PathLike) -> Scenario:
    """Load and validate one scenario file; raises ScenarioError listing every problem."""
    scenario, problems, _, _ = _load(Path(path))
    if problems or scenario is None:
        raise ScenarioError(problems)
    return scenario


def _expand(paths: Iterable[str | os.PathLike]) -> list[Path]:
    out: list[Path] = []
    for p in paths:
        p = Path(p)
        found = sorted(p.glob("*.yaml")) if p.is_dir() else [p]
        for f in found:
            if f not in out:
                out.append(f)
    return out


def discover(paths: Iterable[str | os.PathLike] | None = None) -> list[Path]:
    """Scenario files: `paths` (directories expand to their *.yaml), default configs/scenarios."""
    if paths is None:
        return sorted(SCENARIO_DIR.glob("*.yaml"))
    return _expand(paths)


def load_paths(paths: Iterable[str | os.PathLike]
               ) -> tuple[list[Scenario], list[Problem], list[Problem]]:
    """(scenarios, problems, warnings) of every file under `paths`, each file read once; a
    scenario name used by two files is a problem too."""
    scenarios: list[Scenario] = []
    problems: list[Problem] = []
    warnings: list[Problem] = []
    names: dict[str, tuple[str, int | None]] = {}
    for f in _expand(paths):
        scenario, found, name, line = _load(f)
        problems.extend(found)
        if scenario is not None:
            scenarios.append(scenario)
            warnings.extend(scenario.warnings)
        if name is None:
            continue
        if name in names:
            first_file, first_line = names[name]
            problems.append(Problem(str(f), line, "name", f"duplicate scenario name {name!r} "
                                                          f"(also in {first_file}:{first_line})"))
        else:
            names[name] = (str(f), line)
    return scenarios, problems, warnings


def check_paths(paths: Iterable[str | os.PathLike]) -> tuple[list[Problem], list[Problem]]:
    """(problems, warnings) of every file under `paths` (see load_paths)."""
    _, problems, warnings = load_paths(paths)
    return problems, warnings


def validate_paths(paths: Iterable[str | os.PathLike]) -> list[Problem]:
    """Every problem of the files under `paths` (warnings left out: see check_paths)."""
    return check_paths(paths)[0]


def engine_spec(s: Scenario) -> dict:
    """What the engine's --scenario file holds: name, seed, the scenario's knobs (seed
    included) as JSON values, and the perturbations as written in the YAML."""
    raw = s.raw.get("perturbations") if isinstance(s.raw, dict) else None
    return {"name": s.name, "seed": s.seed, "engine": s.engine_knobs,
            "perturbations": list(raw or [])}
