"""Imported last by the soak's forkserver (``soak_trials.context``): freeze the server's heap.

Every rank of a trial is forked from a server that has torch and gemini_dcp imported (~280 MB).
A forked child's garbage collector walks every object it inherited and so writes to (and the
kernel copies) most of those pages, in every rank of every trial. ``gc.freeze`` moves the
server's objects out of the collector's reach, so a child copies only what it really changes.
"""

import gc

gc.collect()
gc.freeze()
