"""A Triton kernel launch as data: kernel, grid, arguments.

The launchers build their launches through one function each and then run them; the
ahead-of-time check (:mod:`.aot`) calls the same functions and hands the arguments to Triton's
own specialization (the JIT's argument binder), so what it compiles is what the launcher runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class KernelLaunch:
    """One launch of a ``@triton.jit`` kernel.

    Attributes:
        kernel: the JIT function.
        grid: launch grid (1 to 3 program counts).
        args: positional arguments, in the kernel's parameter order.
        kwargs: constexpr arguments and launch options (``num_warps``, ``num_stages``).
    """

    kernel: Any
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)

    def run(self) -> None:
        """Launch on the current device/stream (or in the interpreter under TRITON_INTERPRET=1)."""
        self.kernel[self.grid](*self.args, **self.kwargs)
