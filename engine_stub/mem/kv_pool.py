"""HybridKVPool: the physical K/V buffers of the full-attention and sliding-window layers."""

from __future__ import annotations

import torch

__all__ = ["HybridKVPool"]


class HybridKVPool:
    """Per-layer K and V buffers. Full layers have `full_size + page_size` rows, SWA layers
    `swa_size + page_size`; row (page) 0 is the padding sink.

    Callers pass FULL slot indices everywhere; SWA layers translate them through the allocator's
    `full_to_swa_index_mapping`, which this pool holds by identity (it is mutated in place). The
    allocator hands it over with `register_mapping` (SGLang's `BaseSWAKVPool.register_mapping`)
    when built with `kvcache=` this pool; a caller may also pass it at construction.

    Storage is one buffer per group (`group_kv`), `[rows, layers_of_group, 2 (K, V), heads,
    head_dim]`; `k_buffer[layer]` and `v_buffer[layer]` are views into it. A slot's K/V bytes of
    every layer of a group are then one contiguous row, which the KV canary hashes with one gather.
    """

    def __init__(
        self,
        *,
        layer_pattern: str,
        full_size: int,
        swa_size: int,
        page_size: int,
        num_heads: int,
        head_dim: int,
        full_to_swa_index_mapping: torch.Tensor | None = None,
        dtype: torch.dtype = torch.float64,
        device: torch.device | str = "cpu",
    ) -> None:
        self.layer_pattern = layer_pattern
        self.is_swa_layer = [kind == "S" for kind in layer_pattern]
        self.full_rows = full_size + page_size
        self.swa_rows = swa_size + page_size
        self.dtype = dtype
        self.full_to_swa_index_mapping = full_to_swa_index_mapping
        self._group_kv = {
            swa: torch.zeros((self.swa_rows if swa else self.full_rows, self.is_swa_layer.count(swa), 2,
                              num_heads, head_dim), dtype=dtype, device=device)
            for swa in (False, True)
        }
        self.k_buffer: list[torch.Tensor] = []
        self.v_buffer: list[torch.Tensor] = []
        for layer, is_swa in enumerate(self.is_swa_layer):
            index = self.is_swa_layer[:layer].count(is_swa)  # the layer's place in its group
            self.k_buffer.append(self._group_kv[is_swa][:, index, 0])
            self.v_buffer.append(self._group_kv[is_swa][:, index, 1])

    def register_mapping(self, full_to_swa_index_mapping: torch.Tensor) -> None:
        """Hold the allocator's mapping (by identity) for the SWA layers' translation."""
        self.full_to_swa_index_mapping = full_to_swa_index_mapping

    def rows_of(self, layer: int, full_slots: torch.Tensor) -> torch.Tensor:
        """Buffer rows of `full_slots` in `layer` (SWA layers go through the mapping)."""
        if self.is_swa_layer[layer]:
            return self.full_to_swa_index_mapping[full_slots.to(torch.int64)]
        return full_slots.to(torch.int64)

    def set_kv(self, layer: int, full_slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.set_kv_rows(layer, self.rows_of(layer, full_slots), k, v)

    def get_kv(self, layer: int, full_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.get_kv_rows(layer, self.rows_of(layer, full_slots))

    def set_kv_rows(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """`set_kv` at buffer rows already translated by `rows_of` (a forward translates a step's
        slots once per group, not once per layer: the mapping cannot move inside a forward)."""
        self.k_buffer[layer].index_copy_(0, rows, k)
        self.v_buffer[layer].index_copy_(0, rows, v)

    def get_kv_rows(self, layer: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`get_kv` at buffer rows already translated by `rows_of`."""
        return self.k_buffer[layer][rows], self.v_buffer[layer][rows]

    def group_layers(self, swa: bool) -> list[int]:
        return [i for i, is_swa in enumerate(self.is_swa_layer) if is_swa == swa]

    def group_kv(self, swa: bool) -> torch.Tensor:
        """The group's buffer `[rows, len(group_layers(swa)), 2, heads, head_dim]`: row r holds
        K then V of each of the group's layers, in layer order."""
        return self._group_kv[swa]
