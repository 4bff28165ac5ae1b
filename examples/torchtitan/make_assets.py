"""Offline assets for the torchtitan example: a small byte-level BPE tokenizer and a JSON-lines corpus.

torchtitan's wheel ships no ``tests/assets`` and a CPU box may have no network, so the example makes its own:
``OUT/tokenizer/`` (``tokenizer.json`` + ``tokenizer_config.json``, vocab <= 2048, the llama3 debugmodel's:
``--hf_assets_path``) and ``OUT/data/data.jsonl`` (one ``{"text": ...}`` per line, what the ``c4_test``
loader reads from a local folder: ``--dataloader.dataset_path``; the folder must hold nothing else). Deterministic: the
same folder every time, so two runs see the same tokens.

    python examples/torchtitan/make_assets.py OUT_DIR
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

WORDS = (
    "memory checkpoint tier peer node rank step shard tensor gradient optimizer restore failure recovery "
    "training model layer attention token batch sequence loss learning rate warmup schedule replica store "
    "persistent local network bandwidth latency commit record slot page fault copy verify checksum"
).split()


def corpus(n_docs: int = 400, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    docs = []
    for _ in range(n_docs):
        sentences = []
        for _ in range(rng.randint(3, 8)):
            words = [rng.choice(WORDS) for _ in range(rng.randint(5, 14))]
            sentences.append(" ".join(words).capitalize() + ".")
        docs.append(" ".join(sentences))
    return docs


def make(out: Path, vocab_size: int = 1024) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    (out / "tokenizer").mkdir(parents=True, exist_ok=True)
    (out / "data").mkdir(parents=True, exist_ok=True)
    docs = corpus()
    (out / "data" / "data.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    tok.save(str(out / "tokenizer" / "tokenizer.json"))
    (out / "tokenizer" / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>",
        "add_bos_token": True, "add_eos_token": True, "model_max_length": 4096,
    }))
    return out


if __name__ == "__main__":
    print(make(Path(sys.argv[1] if len(sys.argv) > 1 else "outputs/assets")))
