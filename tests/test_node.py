"""gemini_dcp.node: the node's tiers opened once from the options tree (no processes)."""

from __future__ import annotations

from pathlib import Path

from gemini_dcp.node import open_tiers
from gemini_dcp.options import GeminiOptions, LocalOptions, PersistentOptions


def test_open_tiers_builds_the_local_tier_and_node_id(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    tiers = open_tiers(GeminiOptions(local=LocalOptions(root=str(root), job_id="n", node_id="node-a")), writable=True)
    assert tiers.tier.root == root and tiers.tier.job_id == "n" and tiers.node_id == "node-a"
    assert tiers.persistent is None


def test_open_tiers_opens_the_store_with_the_options_deadline(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    opts = GeminiOptions(local=LocalOptions(root=str(root), job_id="n"),
                         persistent=PersistentOptions(url="memory://node-test", keep=3), timeout_s=7.0)
    tiers = open_tiers(opts, writable=False)
    assert tiers.persistent is not None and tiers.persistent.job_id == "n"
    assert (tiers.persistent.keep, tiers.persistent.timeout_s, tiers.persistent.writable) == (3, 7.0, False)
