"""The peer tier. Names of the former flat module ``gemini_dcp.peer`` resolve here on first use."""

from typing import Any


def __getattr__(name: str) -> Any:
    import importlib  # noqa: PLC0415 - keeps the package face light

    module = importlib.import_module(f"{__name__}.replication")
    try:
        return getattr(module, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
