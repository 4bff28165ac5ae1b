"""torchtitan's ``ModelWrapper`` state-dict semantics (0.3.0), for tests of ModelStatesCache without torchtitan."""

from __future__ import annotations

from typing import Any


def _storage(t: Any) -> int:
    return int(getattr(t, "_local_tensor", t).untyped_storage().data_ptr())


class ModelWrapperStub:
    """A cached flattened state dict whose hook-made values are refreshed in place, as torchtitan's."""

    def __init__(self, model: Any) -> None:
        self.model = [model]
        self.cached_state_dict = self._get_state_dict()

    def _get_state_dict(self) -> dict[str, Any]:
        return {k: v for m in self.model for k, v in m.state_dict().items()}

    def state_dict(self) -> dict[str, Any]:
        for key, value in self._get_state_dict().items():
            cached = self.cached_state_dict.get(key)
            if cached is None or cached.shape != value.shape or cached.dtype != value.dtype:
                self.cached_state_dict[key] = value
            elif _storage(cached) != _storage(value):
                cached.copy_(value)
        return self.cached_state_dict
