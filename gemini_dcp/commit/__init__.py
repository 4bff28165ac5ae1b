"""The commit protocol of a save, apart from the DCP adapter that drives it.

- :mod:`.protocol`: THE protocol (agree, write local, report/gather, replicate, build the
  record, commit on each node, evict, hand off to the drain) and its glossary;
- :mod:`.agreement`: the pre-write MIN all-reduce (G, a repeated step, a failed commit);
- :mod:`.reports`: each rank's report at the commit gather, and its compact form;
- :mod:`.slot_pool`: the slot files a writer maps on its node (lookup, budget, space, growth);
- :mod:`.hooks`: the async path's pacers and copy-done callback, as one value.
"""
