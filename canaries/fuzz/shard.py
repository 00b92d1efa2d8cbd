"""`--shard I/N`: which part of a campaign one CI runner takes."""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["WHOLE", "Shard", "parse_shard"]


@dataclass(frozen=True)
class Shard:
    """Part `index` (1-based) of `count`. Unsteered, it takes every `count`th index of the seed's
    sequence from `index - 1` (disjoint parts that together are the sequence); steered, it is a
    sub-campaign of its own, seeded from (seed, index), sharing the seed corpus."""

    index: int = 1
    count: int = 1

    def __post_init__(self) -> None:
        if self.count < 1 or not 1 <= self.index <= self.count:
            raise ValueError(f"--shard {self.index}/{self.count}: I/N needs 1 <= I <= N")

    @property
    def whole(self) -> bool:
        return self.count == 1

    def global_index(self, local: int) -> int:
        """The seed's sequence index of this shard's `local`th scenario."""
        return local * self.count + self.index - 1

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


WHOLE = Shard()  # the whole campaign, unsharded


def parse_shard(text: str) -> Shard:
    """`2/4` -> Shard(2, 4); anything else raises ValueError naming `--shard`."""
    match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text or "")
    if not match:
        raise ValueError(f"--shard {text!r}: expected I/N such as 2/4")
    return Shard(int(match.group(1)), int(match.group(2)))
