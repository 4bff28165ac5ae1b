"""Every Python block of docs/integrations.md, docs/getting-started.md and README.md's "Usage" runs somewhere.

- A block that is a trainer's loop (Lightning, Accelerate) is a copy of an ``examples/`` file's lines between
  ``# docs: <name>`` and ``# /docs`` (lines marked ``# example-only`` left out; several regions of one name joined
  by an empty line): checked here, line for line;
  the example runs in tests/test_lightning_e2e.py / tests/test_accelerate_e2e.py (kill, resume, bit-exact).
- Every other block (plain ``dcp.save`` loops, ``dcp.async_save``, the README's usage) is executed here, as
  written, on 2 ranks that are 2 simulated nodes (``replicas=2`` has a peer), twice: a first launch trains
  to step 3, a second launch resumes through the block's own lines and trains to step 5. The one thing the
  test swaps is the persistent store's URL (``s3://...`` becomes a ``file://`` folder). Blocks of one section
  run in order in one namespace, after a prelude that defines ``model``, ``opt``, ``state_dict``,
  ``train_step`` and ``steps``.
- torchtitan's blocks are compiled only: the torchtitan e2e test (its own venv) runs that integration.

No block may catch ``BaseException``: resuming is ``newest_restorable_step`` (None: nothing to resume).
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path
from typing import Any

from mp_utils import node_root_factory, run_ranks

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs" / "integrations.md"
GETTING_STARTED = REPO / "docs" / "getting-started.md"
README = REPO / "README.md"
EXAMPLES = {  # the block's section -> (example file, region name, the test that runs it)
    "Lightning": ("examples/lightning_resume.py", "lightning", "tests/test_lightning_e2e.py"),
    "Accelerate": ("examples/accelerate_resume.py", "accelerate", "tests/test_accelerate_e2e.py"),
    "DeepSpeed": ("examples/deepspeed_resume.py", "deepspeed", "tests/test_deepspeed_e2e.py"),
}
COMPILED_ONLY = ("torchtitan",)


def sections(path: Path) -> list[tuple[str, list[str]]]:
    """(heading, python blocks) for every ``##`` section of ``path``, in order."""
    out: list[tuple[str, list[str]]] = []
    for part in re.split(r"^## ", path.read_text(), flags=re.M)[1:]:
        heading = part.splitlines()[0].strip()
        out.append((heading, re.findall(r"```python\n(.*?)```", part, flags=re.S)))
    return out


def region(example: str, name: str) -> str:
    """An example's lines between ``# docs: name`` and ``# /docs``, dedented, ``# example-only`` lines left out;
    several such regions (a ``train_dataloader`` and the trainer's lines) are joined by one empty line, in order."""
    text = (REPO / example).read_text()
    found = re.findall(rf"^[ \t]*# docs: {name}\n(.*?)^[ \t]*# /docs\n", text, flags=re.S | re.M)
    assert found, f"{example} has no '# docs: {name}' region"
    return "\n".join(textwrap.dedent("".join(ln + "\n" for ln in part.splitlines() if "# example-only" not in ln))
                     for part in found)


def all_blocks() -> list[tuple[str, str, str]]:
    """(file, section, block) for every Python block the test covers."""
    blocks = [("integrations.md", h, b) for h, bs in sections(DOCS) for b in bs]
    blocks += [("getting-started.md", h, b) for h, bs in sections(GETTING_STARTED) for b in bs]
    blocks += [("README.md", h, b) for h, bs in sections(README) if h == "Usage" for b in bs]
    return blocks


def test_every_block_is_covered_and_none_catches_base_exception() -> None:
    seen = {h for _, h, _ in all_blocks()}
    assert {"Lightning", "Accelerate", "Usage", "Add it to your loop"} <= seen, seen
    for where, heading, block in all_blocks():
        assert "BaseException" not in block, (where, heading)
        compile(block, f"{where}:{heading}", "exec")
        if heading in EXAMPLES:
            example, name, test = EXAMPLES[heading]
            assert block == region(example, name), f"{where} {heading!r} is not {example}'s '{name}' region"
            assert example.split("/")[-1] in (REPO / test).read_text()


PRELUDE = """
import torch
torch.manual_seed(0)
model = torch.nn.Linear(16, 16)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
state_dict = {"model": model.state_dict()}           # DCP loads into these tensors in place
steps = STEPS
trained = []
def train_step():
    opt.zero_grad()
    model(torch.ones(4, 16)).square().mean().backward()
    opt.step()
    trained.append(1)
"""


def _run_blocks(rank: int, world_size: int, root: str, sections: list[list[str]], steps: int, store: str) -> list[int]:
    """Each section's blocks in order, in one namespace after the prelude; the steps each section trained."""
    import os

    os.environ["GEMINI_DCP_ROOT"] = root
    ns: dict[str, Any] = {}
    exec(compile(PRELUDE.replace("STEPS", str(steps)), "prelude", "exec"), ns)  # noqa: S102 - the docs' own code
    trained = []
    for blocks in sections:
        before = len(ns["trained"])
        for i, block in enumerate(blocks):
            exec(compile(re.sub(r"s3://[^\"']+", store, block), f"block {i}", "exec"), ns)  # noqa: S102
        trained.append(len(ns["trained"]) - before)
    return trained


def test_blocks_run_and_resume(tmp_path: Path) -> None:
    """All executed sections in one pair of launches (each its own job id): 3 steps, then 2 more after a resume."""
    names = sorted({(w, h) for w, h, _ in all_blocks() if h not in EXAMPLES and not h.startswith(COMPILED_ONLY)})
    assert len(names) >= 4, names  # the plain loop, dcp.async_save, the README's usage, getting started
    jobs = [re.findall(r'job_id="([^"]+)"', "".join(b for w, h, b in all_blocks() if (w, h) == n)) for n in names]
    assert len({j for js in jobs for j in js}) == len(names), f"each section needs a job id of its own: {jobs}"
    blocks = [[b for w, h, b in all_blocks() if (w, h) == n] for n in names]
    roots, cleanup = node_root_factory("snippets")
    try:
        nodes = roots(2)
        store = f"file://{tmp_path}/persistent"
        first = run_ranks(_run_blocks, 2, nodes, sections=blocks, steps=3, store=store)
        assert first == [[3] * len(names)] * 2, (names, first)  # nothing to resume: steps 1..3
        second = run_ranks(_run_blocks, 2, nodes, sections=blocks, steps=5, store=store)
        assert second == [[2] * len(names)] * 2, (names, second)  # resumed at step 3: steps 4..5
    finally:
        cleanup()
