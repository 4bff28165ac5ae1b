"""The persistent tier: the store, its step directories and reads, the stock DCP layout, the drain."""
