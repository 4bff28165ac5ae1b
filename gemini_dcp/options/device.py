"""Options of the GPU paths: the only reader of ``GEMINI_DCP_D2H_CHECKSUM``,
``GEMINI_DCP_H2D_REGISTER`` and ``GEMINI_DCP_H2D_VERIFY``.

``GEMINI_DCP_D2H_CHECKSUM``
    how a CUDA tensor's bytes are checksummed when a save copies them into the tier
    (:mod:`gemini_dcp.save.device_copy`): ``auto`` (default: ``gpu`` where the extension's CUDA ops
    are loaded, else ``cpu``), ``gpu`` (``xsum64`` computed on the GPU; the CPU never reads the
    bytes) or ``cpu`` (the slot's crc32c/xxh3 over each landed piece).
``GEMINI_DCP_H2D_REGISTER``
    whether a restore onto CUDA tensors page-locks the slot mappings it copies from
    (:mod:`gemini_dcp.restore.device_land`): ``auto`` (default: a mapping of which at least 64 MiB and
    half go to the GPU), ``1`` (always) or ``0`` (never: pageable copies).
``GEMINI_DCP_H2D_VERIFY``
    where a restore onto CUDA tensors verifies a chunk checksummed on the GPU at save time
    (``xsum64``; :mod:`gemini_dcp.restore.restore_stage`): ``auto`` (default: ``gpu`` where the
    extension's CUDA ops are loaded), ``gpu`` (host-to-device into a staging buffer on the GPU, the
    checksum there, device-to-device into the destination at the landing: the CPU never reads the
    bytes) or ``cpu`` (the CPU kernel over the tier's bytes, then host-to-device).

Torch-free: reading the options never imports torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, cast

from ..errors import ConfigError
from .env import env_choice, env_str

__all__ = ["D2HChecksum", "DeviceOptions", "H2DRegister", "H2DVerify"]

D2HChecksum = Literal["auto", "gpu", "cpu"]
H2DRegister = Literal["auto", "always", "never"]
H2DVerify = Literal["auto", "gpu", "cpu"]
_VERIFY: tuple[H2DVerify, ...] = ("auto", "gpu", "cpu")
_D2H: tuple[D2HChecksum, ...] = ("auto", "gpu", "cpu")
_H2D: tuple[H2DRegister, ...] = ("auto", "always", "never")
_H2D_ALIASES = {"1": "always", "on": "always", "true": "always", "yes": "always",
                "0": "never", "off": "never", "false": "never", "no": "never"}


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceOptions:
    """How CUDA tensors reach the tier and come back (module docstring)."""

    d2h_checksum: D2HChecksum = "auto"
    h2d_register: H2DRegister = "auto"
    h2d_verify: H2DVerify = "auto"

    def __post_init__(self) -> None:
        if self.d2h_checksum not in _D2H:
            raise ConfigError(f"DeviceOptions(d2h_checksum={self.d2h_checksum!r}): choose 'auto' (default), 'gpu' or 'cpu'.")
        if self.h2d_register not in _H2D:
            raise ConfigError(f"DeviceOptions(h2d_register={self.h2d_register!r}): choose 'auto' (default), 'always' or 'never'.")
        if self.h2d_verify not in _VERIFY:
            raise ConfigError(f"DeviceOptions(h2d_verify={self.h2d_verify!r}): choose 'auto' (default), 'gpu' or 'cpu'.")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> DeviceOptions:
        """The options the three variables set (``environ`` defaults to ``os.environ``); a bad value
        raises :class:`~gemini_dcp.errors.ConfigError` naming the variable and what it accepts."""
        try:
            d2h = env_choice("GEMINI_DCP_D2H_CHECKSUM", _D2H, "auto", environ)
        except ConfigError:
            raise ConfigError(f"GEMINI_DCP_D2H_CHECKSUM={env_str('GEMINI_DCP_D2H_CHECKSUM', environ=environ)!r}: "
                              "use auto, gpu or cpu, or unset it.") from None
        try:
            h2d = env_choice("GEMINI_DCP_H2D_REGISTER", _H2D, "auto", environ, aliases=_H2D_ALIASES)
        except ConfigError:
            raise ConfigError(f"GEMINI_DCP_H2D_REGISTER={env_str('GEMINI_DCP_H2D_REGISTER', environ=environ)!r}: "
                              "use auto, 1 (always) or 0 (never), or unset it.") from None
        try:
            verify = env_choice("GEMINI_DCP_H2D_VERIFY", _VERIFY, "auto", environ)
        except ConfigError:
            raise ConfigError(f"GEMINI_DCP_H2D_VERIFY={env_str('GEMINI_DCP_H2D_VERIFY', environ=environ)!r}: "
                              "use auto, gpu or cpu, or unset it.") from None
        return cls(d2h_checksum=cast(D2HChecksum, d2h), h2d_register=cast(H2DRegister, h2d),
                   h2d_verify=cast(H2DVerify, verify))
