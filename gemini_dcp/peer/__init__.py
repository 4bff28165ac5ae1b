"""The peer tier: replicas of each node's checkpoint in other nodes' CPU memory.

Modules by concern: ``placement`` (which nodes hold which copies: pure), ``routes``
(node positions, replication routes: pure), ``push`` (the save side: replicate and
verify), ``fetch`` (the restore side: route, fetch, repair), ``arena`` (receive
buffers), ``delta`` (row deltas of a replica), ``parity``/``parity_groups`` (XOR parity).
Bytes move only through :mod:`gemini_dcp.transport.p2p`; nothing here imports the DCP
adapters (:mod:`gemini_dcp.dcp`), which call in with narrow values.
"""
