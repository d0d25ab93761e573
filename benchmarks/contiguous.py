"""Contiguous KV reservation, as in serving systems before PagedAttention (Orca, FasterTransformer).

Each request gets one contiguous range of token slots in a linear KV address space, reserved at
admission for its whole lifetime; a first-fit allocator places it, so the holes left by finished
requests (external fragmentation) show. Three reservation policies, after Kwon et al., SOSP'23,
Fig. 2 / §6.2 (Orca Max / Pow2 / Oracle):

- ``max``: the model's maximum sequence length;
- ``pow2``: the prompt plus the output length rounded up to a power of two (a policy that knows
  the output length to within 2x);
- ``oracle``: exactly the request's KV, prompt + output - 1 tokens (knows the output length; the
  last sampled token is never written).
"""

from __future__ import annotations

import bisect


class FirstFitAllocator:
    """First-fit allocator over the address range ``[0, capacity)`` (units: token slots).

    Free space is a sorted list of disjoint holes ``(start, length)``; freeing coalesces with the
    neighbours. ``allocate`` and ``free`` are O(holes).
    """

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._starts: list[int] = [0]
        self._lens: list[int] = [capacity]
        self.allocated = 0

    @property
    def free(self) -> int:
        """Total free slots (in all holes)."""
        return self.capacity - self.allocated

    @property
    def largest_hole(self) -> int:
        """Length of the largest hole (0 when full)."""
        return max(self._lens, default=0)

    def allocate(self, size: int) -> int | None:
        """Reserve ``size`` contiguous slots at the lowest address that fits; returns the start
        address, or None (state unchanged) when no hole is large enough."""
        if size <= 0:
            raise ValueError(f"size must be positive, got {size}")
        for i, ln in enumerate(self._lens):
            if ln >= size:
                start = self._starts[i]
                if ln == size:
                    del self._starts[i]
                    del self._lens[i]
                else:
                    self._starts[i] = start + size
                    self._lens[i] = ln - size
                self.allocated += size
                return start
        return None

    def free_range(self, start: int, size: int) -> None:
        """Return ``[start, start + size)`` to the free space, merging adjacent holes.

        Raises ValueError if the range is out of bounds or overlaps a hole (a double free).
        """
        if start < 0 or size <= 0 or start + size > self.capacity:
            raise ValueError(f"bad range start={start} size={size} for capacity {self.capacity}")
        i = bisect.bisect_left(self._starts, start)
        if i < len(self._starts) and self._starts[i] < start + size:
            raise ValueError(f"range start={start} size={size} overlaps a free hole")
        if i > 0 and self._starts[i - 1] + self._lens[i - 1] > start:
            raise ValueError(f"range start={start} size={size} overlaps a free hole")
        merge_prev = i > 0 and self._starts[i - 1] + self._lens[i - 1] == start
        merge_next = i < len(self._starts) and self._starts[i] == start + size
        if merge_prev and merge_next:
            self._lens[i - 1] += size + self._lens[i]
            del self._starts[i]
            del self._lens[i]
        elif merge_prev:
            self._lens[i - 1] += size
        elif merge_next:
            self._starts[i] = start
            self._lens[i] += size
        else:
            self._starts.insert(i, start)
            self._lens.insert(i, size)
        self.allocated -= size


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (n >= 1)."""
    return 1 << max(0, (n - 1).bit_length())


def reservation(policy: str, prompt_len: int, output_len: int, max_len: int) -> int:
    """Slots a contiguous system reserves for a request under ``policy`` (see module docstring),
    never more than ``max_len`` nor less than the request's own KV (prompt + output - 1)."""
    need = prompt_len + output_len - 1
    if policy == "max":
        r = max_len
    elif policy == "pow2":
        r = prompt_len + next_pow2(output_len)
    elif policy == "oracle":
        r = need
    else:
        raise ValueError(f"reservation policy must be max, pow2 or oracle, got {policy!r}")
    return max(need, min(r, max_len))
