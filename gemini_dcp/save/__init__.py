"""The save's copy engine: one rank's bytes of one save, copied and checksummed into its slot.

:mod:`.local_write` (``LocalWriter``) is the seam the DCP writer calls: it compiles a write
program once per plan structure and runs it into a slot, small items copied in batches; the
other strategies of that program are carrying unchanged tensors of incremental saves
(:mod:`.carry`), row deltas (:mod:`.row_delta`) and the device-to-host copy of CUDA tensors
(:mod:`.device_copy`). Nothing here knows DCP's ``StorageWriter`` contract (that is :mod:`gemini_dcp.dcp.writer`) or the commit protocol.
"""
