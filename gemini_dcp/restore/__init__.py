"""The restore engine: where a load's bytes are staged, verified and landed.

:mod:`.restore_stage` (``RestoreStage``) stages each chunk from the tier that holds it and
verifies its checksum; :mod:`.device_land` lands staged bytes on the device;
:mod:`.state_dict_check` checks a state dict against the saved metadata;
:mod:`.parity_restore` rebuilds a lost node's bytes from XOR parity; :mod:`.fast_plan` maps
a state dict straight onto a step record for ``fast_load``. Nothing here knows DCP's
``StorageReader`` contract (that is :mod:`gemini_dcp.dcp.reader`).
"""
