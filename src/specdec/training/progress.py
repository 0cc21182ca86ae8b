"""A do-nothing progress bar with tqdm's interface, the default for library calls."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class NullBar:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.n = kwargs.get("initial", 0)

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_postfix(self, *args: Any, **kwargs: Any) -> None:
        pass

    def set_description(self, *args: Any, **kwargs: Any) -> None:
        pass

    def write(self, *args: Any, **kwargs: Any) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> NullBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


ProgressFactory = Callable[..., Any]
"""``factory(total=..., desc=..., initial=...)`` returning an object with tqdm's ``update``,
``set_postfix``, ``write`` and ``close``; pass ``tqdm.tqdm`` to see bars."""
