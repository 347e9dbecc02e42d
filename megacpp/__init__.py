"""megacpp: train hybrid language models for code, and use them (`megacpp.load`, megacpp.api)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megacpp.api import load


def __getattr__(name: str) -> Any:
    # Lazy: `import megacpp` (and with it `megacpp --help` and `megacpp config`) loads no torch.
    if name == "load":
        from megacpp.api import load

        return load
    raise AttributeError(f"module 'megacpp' has no attribute {name!r}")


__all__ = ["load"]
