"""Memory: exact accounting of what a rank holds, and the techniques that make long sequences fit
(tiled MLP, activation offload to host memory, FSDP2 CPU offload, the CUDA allocator's setting)."""

from .accounting import CATEGORIES, MemoryReport, MemoryTracker, prime_optimizer

__all__ = ["CATEGORIES", "MemoryReport", "MemoryTracker", "prime_optimizer"]
