"""`canary bisect GOOD BAD SCENARIO`: the first engine commit at which a scenario's verdict changed.

Drives `git bisect run` in a worktree of its own (the user's checkout and its bisect state are
never touched). Each step runs the scenario with this checkout's harness and the engine sources
of the commit under test (`engine_root`), so old commits are judged by today's suite. A commit
whose engine does not start (it does not import, build or bind) is skipped (exit 125).

    python -P -m canaries.triage.bisect --step ...    # what `git bisect run` calls per commit
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["BisectError", "BisectResult", "bisect"]

GOOD, BAD, SKIP = 0, 1, 125


class BisectError(RuntimeError):
    """Bisect cannot run (not a repo, unknown commit, no verdict change); the message says why."""


@dataclass
class BisectResult:
    first_bad: str
    subject: str
    good_verdict: str
    bad_verdict: str
    log: list[str] = field(default_factory=list)

    def to_text(self) -> str:
        return (f"first commit with the changed verdict ({self.good_verdict} -> {self.bad_verdict}):\n"
                f"  {self.first_bad} {self.subject}")


def _git(repo: Path, *args: str, check: bool = True) -> str:
    proc = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise BisectError(f"git {' '.join(args)}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout.strip()


def _engine_failed_to_start(record) -> bool:
    reason = (record.reason or "") + str(record.extra.get("error") or "")
    return record.verdict == "INCONCLUSIVE" and ("before it was ready" in reason or "not ready" in reason)


def judge_commit(scenario_path: Path, engine_root: Path, out_dir: Path, runtime: str) -> tuple[str, bool]:
    """(verdict, started) of the scenario with the engine under `engine_root`."""
    from canaries.runner import run_scenario
    from canaries.runtime.warm import close_fork_server
    from canaries.scenario import load_scenario

    try:
        record = run_scenario(load_scenario(scenario_path), out_dir, runtime=runtime,
                              engine_root=engine_root)
    finally:
        close_fork_server(engine_root=engine_root)  # the next commit's sources differ
    return record.verdict, not _engine_failed_to_start(record)


def _step_command(scenario: Path, engine_root: Path, good_verdict: str, out_root: Path, runtime: str) -> list[str]:
    # -P: the harness must not import the worktree's own (older) canaries from the cwd.
    return [sys.executable, "-P", "-m", "canaries.triage.bisect", "--step", "--scenario", str(scenario),
            "--engine-root", str(engine_root), "--good-verdict", good_verdict, "--out", str(out_root),
            "--runtime", runtime]


def bisect(good: str, bad: str, scenario: str | Path, *, repo: str | Path | None = None,
           runtime: str = "local", work_dir: str | Path | None = None) -> BisectResult:
    """Find the first commit in (GOOD, BAD] of `repo` whose engine changes SCENARIO's verdict."""
    from canaries.runner import repo_root

    repo = Path(repo) if repo is not None else repo_root()
    scenario = Path(scenario).resolve()
    if not scenario.is_file():
        raise BisectError(f"{scenario}: no such scenario file")
    if _git(repo, "rev-parse", "--is-inside-work-tree", check=False) != "true":
        raise BisectError(f"{repo} is not a git work tree")
    good_sha, bad_sha = (_git(repo, "rev-parse", "--verify", f"{ref}^{{commit}}") for ref in (good, bad))
    work = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="canary-bisect-"))
    tree = work / "worktree"
    _git(repo, "worktree", "add", "--detach", str(tree), bad_sha)
    env_root = tree
    try:
        verdicts = {}
        for name, sha in (("good", good_sha), ("bad", bad_sha)):
            _git(tree, "checkout", "--quiet", "--detach", sha)
            verdict, started = judge_commit(scenario, env_root, work / f"endpoint-{name}", runtime)
            if not started:
                raise BisectError(f"the engine at {name} commit {sha[:12]} does not start")
            verdicts[name] = verdict
        if verdicts["good"] == verdicts["bad"]:
            raise BisectError(f"{scenario.name} is {verdicts['good']} at both {good} and {bad}: "
                              "nothing to bisect")
        _git(tree, "bisect", "start", bad_sha, good_sha)
        cmd = _step_command(scenario, env_root, verdicts["good"], work / "steps", runtime)
        env = {**os.environ, "CANARY_ENGINE_START": "fresh",
               "PYTHONPATH": os.pathsep.join(p for p in (str(repo_root()), os.environ.get("PYTHONPATH")) if p)}
        proc = subprocess.run(["git", "-C", str(tree), "bisect", "run", *cmd], capture_output=True,
                              text=True, env=env, check=False)
        if proc.returncode != 0:
            raise BisectError(f"git bisect run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
        first_bad = _git(tree, "rev-parse", "refs/bisect/bad")
        log = _git(tree, "bisect", "log").splitlines()
        subject = _git(tree, "log", "-1", "--format=%s", first_bad)
        return BisectResult(first_bad, subject, verdicts["good"], verdicts["bad"], log)
    finally:
        _git(tree, "bisect", "reset", "--quiet", check=False)
        _git(repo, "worktree", "remove", "--force", str(tree), check=False)
        _git(repo, "worktree", "prune", check=False)
        if work_dir is None:
            shutil.rmtree(work, ignore_errors=True)


def _step(argv: list[str]) -> int:
    """One `git bisect run` step: 0 good (the good verdict), 1 bad, 125 skip (no engine)."""
    parser = argparse.ArgumentParser(prog="canaries.triage.bisect --step")
    parser.add_argument("--step", action="store_true", required=True)
    parser.add_argument("--scenario", required=True, type=Path)
    parser.add_argument("--engine-root", required=True, type=Path)
    parser.add_argument("--good-verdict", required=True)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--runtime", default="local")
    args = parser.parse_args(argv)
    sha = _git(args.engine_root, "rev-parse", "HEAD")
    try:
        verdict, started = judge_commit(args.scenario, args.engine_root, args.out / sha[:12], args.runtime)
    except Exception as exc:  # noqa: BLE001 - a commit the harness cannot even judge is skipped
        print(json.dumps({"commit": sha, "skip": f"{type(exc).__name__}: {exc}"}))
        return SKIP
    print(json.dumps({"commit": sha, "verdict": verdict, "started": started}))
    if not started:
        return SKIP
    return GOOD if verdict == args.good_verdict else BAD


if __name__ == "__main__":
    sys.exit(_step(sys.argv[1:]))
