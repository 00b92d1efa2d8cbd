"""The steering corpus: scenarios that reached something new, and how the next one is picked.

As AFL and syzkaller keep inputs that reached new coverage, `Corpus` keeps every scenario whose
run reached a feature no earlier run had (`features.run_features`), beside the seed corpus (the
library's scenarios, as the generator's documents: forms known to reach what their authors aimed
at). `pick` favours entries holding rare features: an entry's weight is one plus the sum over
its features of 1 / (runs that reached it), divided by the square root of one plus the times it
was picked already, so a corpus does not keep mutating one entry. Seeds carry no features until
a child of theirs runs; they weigh 1.

Deterministic: `feed` applies results in index order only (a result that arrives early waits
for its predecessors), and `pick` reads only what was fed; so the same seed and the same feedback
give the same picks.
"""

from __future__ import annotations

import functools
import math
import random
from collections import Counter
from dataclasses import dataclass

import yaml

__all__ = ["Corpus", "CorpusEntry", "library_seeds"]


@dataclass
class CorpusEntry:
    """One scenario document in the corpus: where it came from, what its run reached."""

    name: str
    doc: dict
    features: frozenset[str] = frozenset()
    picks: int = 0


@functools.lru_cache(maxsize=1)
def library_seeds() -> tuple[tuple[str, dict], ...]:
    """The library's scenarios as generator-shaped documents (name, doc), the seed corpus;
    those on another device or memory path are left out (a campaign runs the native engine)."""
    from canaries.fuzz.mutate import normalized
    from canaries.scenario import SCENARIO_DIR, load_scenario

    out = []
    for path in sorted(SCENARIO_DIR.glob("*.yaml")):
        scenario = load_scenario(path)
        if scenario.engine.memory != "native" or scenario.workload.temperature != 0:
            continue
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        out.append((scenario.name, normalized(scenario, raw)))
    return tuple(out)


class Corpus:
    """The seed entries plus every fed scenario that reached a new feature."""

    def __init__(self, seeds: tuple[tuple[str, dict], ...] = ()) -> None:
        self.entries = [CorpusEntry(name, doc) for name, doc in seeds]
        self.seen: Counter[str] = Counter()
        self.next_fed = 0
        self._early: dict[int, tuple[str, dict, frozenset[str]]] = {}

    def fed_through(self, index: int) -> bool:
        """Whether every result before `index` has been applied."""
        return self.next_fed >= index

    def feed(self, index: int, name: str, doc: dict, features: frozenset[str]) -> list[str]:
        """Apply the result of `index` (held until its predecessors are in); the new features
        of the results applied now."""
        self._early[index] = (name, doc, features)
        new: list[str] = []
        while self.next_fed in self._early:
            name, doc, features = self._early.pop(self.next_fed)
            fresh = sorted(f for f in features if f not in self.seen)
            self.seen.update(features)
            if fresh:
                self.entries.append(CorpusEntry(name, doc, features))
                new += fresh
            self.next_fed += 1
        return new

    def _weight(self, entry: CorpusEntry) -> float:
        rarity = sum(1 / self.seen[f] for f in entry.features if self.seen[f])
        return (1 + rarity) / math.sqrt(1 + entry.picks)

    def pick(self, rng: random.Random) -> CorpusEntry:
        """An entry, favouring rare features and entries picked less."""
        assert self.entries, "pick from an empty corpus"
        entry = rng.choices(self.entries, weights=[self._weight(e) for e in self.entries])[0]
        entry.picks += 1
        return entry
