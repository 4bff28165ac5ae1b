"""Export a step out of the tiers: its model weights as consolidated safetensors (HuggingFace layout), or a
DeepSpeed checkpoint as DeepSpeed's own checkpoint directory (:func:`export_deepspeed`).

    from gemini_dcp.persistent.export import export_safetensors
    path = export_safetensors(1200, "out/", job_id="run1", persistent="s3://bucket/ckpt")

Tensors are read from any tier reachable from this host — this node's memory
records (own and replica slots), else the persistent tier — verified against
their saved checksums, and sharded tensors (DTensor / ShardedTensor / FSDP
chunks) are reassembled from their chunks using the DCP metadata
(``TensorStorageMetadata.size`` and each chunk's offsets). The output is
``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` shards plus
``model.safetensors.index.json`` when larger than ``max_shard_bytes``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from ..errors import CheckpointMismatchError, ConfigError, ShardUnavailableError, UntrustedDataError
from .deepspeed_layout import TAG_KEY, decode_file, deepspeed_files, is_deepspeed_step, tag_value
from .stock_format import StepSource, open_step
from .store import PersistentTier

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def export_safetensors(
    step: int | None,
    out_dir: str | os.PathLike[str],
    *,
    root: str | os.PathLike[str] | None = None,
    job_id: str | None = None,
    persistent: str | PersistentTier | None = None,
    prefix: str = "model.",
    max_shard_bytes: int = 5 << 30,
) -> Path:
    """Write the tensors of ``step`` (None: the newest) whose names start with ``prefix``.

    Names in the output drop ``prefix`` (``model.layers.0.w`` → ``layers.0.w``
    with the default); ``prefix=""`` exports every tensor of the step.
    Returns the path of ``model.safetensors`` or of the index json when sharded.
    Raises ShardUnavailableError if a chunk of a selected tensor is readable
    from no tier on this host, ConfigError if nothing matches ``prefix``.
    """
    from safetensors.torch import save_file  # noqa: PLC0415

    if max_shard_bytes < 1:
        raise ConfigError(f"max_shard_bytes={max_shard_bytes!r}: give a positive size.")
    src = open_step(step, root=root, job_id=job_id, persistent=persistent)
    sdm = src.metadata.state_dict_metadata
    selected = [(fqn, md) for fqn, md in sdm.items() if isinstance(md, TensorStorageMetadata) and fqn.startswith(prefix)]
    if not selected:
        tops = sorted({f.split(".", 1)[0] + "." for f, m in sdm.items() if isinstance(m, TensorStorageMetadata)})
        raise ConfigError(
            f"step {src.step}: no tensor name starts with prefix={prefix!r}; tensor prefixes present: {tops}. "
            "Pass one of them (or prefix='' for every tensor)."
        )
    names = {fqn: fqn[len(prefix):] for fqn, _ in selected}
    if any(not n for n in names.values()):
        raise ConfigError(f"prefix={prefix!r} is a whole tensor name; use a shorter prefix.")
    _check_available(src, selected)

    shards: list[list[tuple[str, TensorStorageMetadata]]] = [[]]
    size = 0
    for fqn, md in selected:
        nbytes = _nbytes(md)
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((fqn, md))
        size += nbytes
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in [out / SINGLE, out / INDEX, *out.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)
    meta = {"format": "pt", "gemini_dcp_step": str(src.step), "gemini_dcp_job": src.job_id}
    n = len(shards)
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards, 1):
        fname = SINGLE if n == 1 else f"model-{i:05d}-of-{n:05d}.safetensors"
        tensors = {names[fqn]: _assemble(src, fqn, md) for fqn, md in shard}
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        tmp = out / f".{fname}.tmp"
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, out / fname)
        weight_map.update({k: fname for k in tensors})
        del tensors
    if n == 1:
        return out / SINGLE
    index = {"metadata": {"total_size": total, **meta}, "weight_map": dict(sorted(weight_map.items()))}
    tmp = out / f".{INDEX}.tmp"
    tmp.write_text(json.dumps(index, indent=2))
    os.replace(tmp, out / INDEX)
    return out / INDEX


def _nbytes(md: TensorStorageMetadata) -> int:
    n = 1
    for d in md.size:
        n *= d
    return n * torch.empty(0, dtype=md.properties.dtype).element_size()


def _check_available(src: StepSource, selected: list[tuple[str, TensorStorageMetadata]]) -> None:
    by_index = {it.index: it for it in src.items}
    missing = []
    for fqn, md in selected:
        for chunk in md.chunks:
            it = by_index.get(MetadataIndex(fqn, chunk.offsets))
            if it is None or it.index not in src.where:
                missing.append(f"{fqn}{list(chunk.offsets)}" + (f"@rank{it.rank}" if it is not None else ""))
    if missing:
        raise ShardUnavailableError(
            f"step {src.step}: {len(missing)} chunk(s) are readable from no tier on this host: {missing[:20]}"
            f"{' ...' if len(missing) > 20 else ''}. Export on a node that holds them, or pass persistent=<url> "
            "if the step was drained."
        )


def _assemble(src: StepSource, fqn: str, md: TensorStorageMetadata) -> torch.Tensor:
    """The full tensor ``fqn``, built from its stored chunks."""
    by_index = {it.index: it for it in src.items}
    full = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    covered = 0
    for chunk in md.chunks:
        item = by_index[MetadataIndex(fqn, chunk.offsets)]
        t = src.read(item).reshape(tuple(chunk.sizes))
        dst = full
        for dim, (off, length) in enumerate(zip(chunk.offsets, chunk.sizes)):
            dst = dst.narrow(dim, off, length)
        dst.copy_(t)
        covered += t.numel()
    if covered != full.numel():
        raise ShardUnavailableError(
            f"{fqn}: its chunks cover {covered} of {full.numel()} elements in the checkpoint metadata; cannot consolidate."
        )
    return full


def export_deepspeed(
    step: int | None,
    out_dir: str | os.PathLike[str],
    *,
    root: str | os.PathLike[str] | None = None,
    job_id: str | None = None,
    persistent: str | PersistentTier | None = None,
) -> Path:
    """Write the DeepSpeed checkpoint held as ``step`` (None: the newest) as DeepSpeed's checkpoint directory.

    ``out_dir/<tag>/`` gets every rank's files (``mp_rank_00_model_states.pt``, ``*zero_pp_rank_<r>_*`` ...)
    written with ``torch.save``, and ``out_dir/latest`` names the tag, so DeepSpeed's ``load_checkpoint``,
    ``zero_to_fp32.py`` and ``ds_to_universal`` read it as one DeepSpeed wrote. Items are read from any tier
    reachable from this host and verified against their checksums. Returns ``out_dir/<tag>``. Raises
    CheckpointMismatchError for a step that holds no DeepSpeed checkpoint, ShardUnavailableError when a
    file's items are readable from no tier here. Needs ``deepspeed`` importable when the files hold its objects.
    """
    src = open_step(step, root=root, job_id=job_id, persistent=persistent)
    if not is_deepspeed_step(src.metadata):
        raise CheckpointMismatchError(
            f"step {src.step} of job {src.job_id!r} holds no DeepSpeed checkpoint (no {TAG_KEY!r} item): use "
            "--format safetensors, or give the job id of the DeepSpeed job."
        )
    sdm = src.metadata.state_dict_metadata
    files = deepspeed_files(src.metadata)
    keys = [TAG_KEY, *(k for f in files.values() for k in f.keys)]
    selected = []
    for k in keys:
        md = sdm[k]
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointMismatchError(f"step {src.step}: {k!r} is not a tensor item; not a gemini_dcp DeepSpeed step.")
        selected.append((k, md))
    _check_available(src, selected)
    values = {k: _assemble(src, k, md) for k, md in selected}
    tag = tag_value(values[TAG_KEY])
    out = Path(out_dir)
    tag_dir = out / tag
    if not tag or os.path.normpath(tag) != tag or tag.startswith(("/", "..")):
        raise UntrustedDataError(f"step {src.step} records DeepSpeed tag {tag!r}, which is no directory name.")
    for f in files.values():
        target = tag_dir / f.name
        if os.path.normpath(f.name) != f.name or f.name.startswith(("/", "..")):
            raise UntrustedDataError(f"step {src.step} holds a DeepSpeed file named {f.name!r}, outside its tag directory.")
        try:
            obj = decode_file(f, values)
        except ImportError as exc:
            raise ConfigError(f"{f.name} holds DeepSpeed objects ({exc}): run the export where deepspeed is installed.") from None
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp")
        torch.save(obj, tmp)
        os.replace(tmp, target)
    tmp = out / ".latest.tmp"
    tmp.write_text(tag)
    os.replace(tmp, out / "latest")
    return tag_dir
