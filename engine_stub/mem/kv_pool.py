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
        shape_full = (self.full_rows, num_heads, head_dim)
        shape_swa = (self.swa_rows, num_heads, head_dim)
        self.k_buffer: list[torch.Tensor] = []
        self.v_buffer: list[torch.Tensor] = []
        for is_swa in self.is_swa_layer:
            shape = shape_swa if is_swa else shape_full
            self.k_buffer.append(torch.zeros(shape, dtype=dtype, device=device))
            self.v_buffer.append(torch.zeros(shape, dtype=dtype, device=device))

    def register_mapping(self, full_to_swa_index_mapping: torch.Tensor) -> None:
        """Hold the allocator's mapping (by identity) for the SWA layers' translation."""
        self.full_to_swa_index_mapping = full_to_swa_index_mapping

    def rows_of(self, layer: int, full_slots: torch.Tensor) -> torch.Tensor:
        """Buffer rows of `full_slots` in `layer` (SWA layers go through the mapping)."""
        if self.is_swa_layer[layer]:
            return self.full_to_swa_index_mapping[full_slots.to(torch.int64)]
        return full_slots.to(torch.int64)

    def set_kv(self, layer: int, full_slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        rows = self.rows_of(layer, full_slots)
        self.k_buffer[layer].index_copy_(0, rows, k)
        self.v_buffer[layer].index_copy_(0, rows, v)

    def get_kv(self, layer: int, full_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.rows_of(layer, full_slots)
        return self.k_buffer[layer][rows], self.v_buffer[layer][rows]

    def group_layers(self, swa: bool) -> list[int]:
        return [i for i, is_swa in enumerate(self.is_swa_layer) if is_swa == swa]
