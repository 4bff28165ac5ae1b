"""Options of the C++/CUDA extension (``gemini_dcp.ext``): the only reader of the ``GEMINI_DCP_EXT*`` variables.

``GEMINI_DCP_EXT``
    ``auto`` (default): build/load when possible, else fall back to pure torch;
    ``0`` (also off/false/no/never): never build; ``1`` (also on/true/yes/force/require[d]):
    the build must succeed.
``GEMINI_DCP_CUDA_EXT``
    the same three settings for the CUDA ops (``auto``: when CUDA and nvcc are there).
``GEMINI_DCP_EXT_CACHE``
    root folder of the build cache (default ``~/.cache/gemini_dcp/ext``).
``GEMINI_DCP_EXT_VERBOSE``
    a flag: print what was built or loaded.

Torch-free: reading the options never imports torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, cast

from ..errors import ConfigError
from .env import env_bool, env_choice, env_str

__all__ = ["BuildMode", "ExtOptions", "MODES", "default_cache_dir"]

BuildMode = Literal["auto", "never", "required"]
MODES: tuple[BuildMode, ...] = ("auto", "never", "required")

# The spellings the variables accept for each mode (env_choice lower-cases the value first).
_ALIASES = {
    "0": "never", "off": "never", "false": "never", "no": "never",
    "1": "required", "on": "required", "true": "required", "yes": "required", "force": "required",
    "require": "required",
}
_MEANING = "auto (build when possible, else use the pure-torch fallbacks), 0 (never build) or 1 (the build must succeed)"


def default_cache_dir() -> Path:
    """``~/.cache/gemini_dcp/ext``: where built libraries are kept when ``GEMINI_DCP_EXT_CACHE`` is unset."""
    return Path.home() / ".cache" / "gemini_dcp" / "ext"


def _mode(name: str, environ: Mapping[str, str] | None) -> BuildMode:
    try:
        return cast(BuildMode, env_choice(name, MODES, "auto", environ, aliases=_ALIASES))
    except ConfigError:
        value = env_str(name, environ=environ)
        raise ConfigError(f"{name}={value!r} is not a valid setting: use {_MEANING}, or unset it.") from None


@dataclass(frozen=True, kw_only=True, slots=True)
class ExtOptions:
    """How :mod:`gemini_dcp.ext` builds and loads its C++/CUDA ops.

    ``mode``: the CPU ops (``never`` wins over everything: nothing is built).
    ``cuda``: the CUDA ops (``required`` also makes the build as a whole required).
    ``cache_dir``: root of the build cache. ``verbose``: print what was built or loaded.
    """

    mode: BuildMode = "auto"
    cuda: BuildMode = "auto"
    cache_dir: Path = field(default_factory=default_cache_dir)
    verbose: bool = False

    def __post_init__(self) -> None:
        for name in ("mode", "cuda"):
            value = getattr(self, name)
            if value not in MODES:
                raise ConfigError(f"ExtOptions({name}={value!r}): use one of {', '.join(map(repr, MODES))}.")
        if isinstance(self.cache_dir, str):
            if not self.cache_dir.strip():
                raise ConfigError("ExtOptions(cache_dir=''): name a folder, or leave it out for the default.")
            object.__setattr__(self, "cache_dir", Path(self.cache_dir).expanduser())
        elif not isinstance(self.cache_dir, Path):
            raise ConfigError(f"ExtOptions(cache_dir={self.cache_dir!r}): expected a path (str or pathlib.Path).")
        if self.cache_dir.exists() and not self.cache_dir.is_dir():
            raise ConfigError(f"the extension cache {self.cache_dir} is a file, not a folder: point "
                              "GEMINI_DCP_EXT_CACHE (or ExtOptions.cache_dir) at a folder, or remove that file.")
        if not isinstance(self.verbose, bool):
            raise ConfigError(f"ExtOptions(verbose={self.verbose!r}): expected True or False.")

    @property
    def required(self) -> bool:
        """Whether a failed build must raise (``mode=required``, or ``cuda=required`` unless ``mode=never``)."""
        return self.mode == "required" or (self.mode != "never" and self.cuda == "required")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ExtOptions:
        """The options the four ``GEMINI_DCP_EXT*`` variables set (``environ`` defaults to ``os.environ``).

        Raises :class:`~gemini_dcp.errors.ConfigError` naming the variable and what it accepts.
        """
        cache = env_str("GEMINI_DCP_EXT_CACHE", environ=environ)
        return cls(
            mode=_mode("GEMINI_DCP_EXT", environ),
            cuda=_mode("GEMINI_DCP_CUDA_EXT", environ),
            cache_dir=Path(cache).expanduser() if cache else default_cache_dir(),
            verbose=env_bool("GEMINI_DCP_EXT_VERBOSE", False, environ),
        )
