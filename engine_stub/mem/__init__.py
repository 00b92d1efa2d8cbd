"""The KV memory path: sub-allocators, the hybrid SWA allocator and the req-to-token table."""

from engine_stub.mem.allocator import (
    BaseTokenToKVPoolAllocator,
    PagedTokenToKVPoolAllocator,
    TokenToKVPoolAllocator,
    create_sub_allocator,
)
from engine_stub.mem.req_to_token import ReqToTokenPool
from engine_stub.mem.swa import PureSWATokenToKVPoolAllocator, SWATokenToKVPoolAllocator

__all__ = [
    "BaseTokenToKVPoolAllocator",
    "PagedTokenToKVPoolAllocator",
    "PureSWATokenToKVPoolAllocator",
    "ReqToTokenPool",
    "SWATokenToKVPoolAllocator",
    "TokenToKVPoolAllocator",
    "create_sub_allocator",
]
