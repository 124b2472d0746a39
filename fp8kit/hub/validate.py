"""Proof that an FP8 variant stays close to its source, measured the same way for every upload.

The FP8 model is loaded by transformers (+ compressed-tensors) exactly as users will load it, and compared
with the source on a text sample shipped in the package: mean per-token KL, top-1 agreement, and the
ratio of perplexities on the sample. A source without a tokenizer is measured on seeded random token ids.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path

import torch

from fp8kit.errors import Fp8kitError, first_line
from fp8kit.quality import load_causal_lm, logit_drift, perplexity, quiet

SAMPLE = Path(__file__).parents[1] / "data" / "sample.txt"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


def sample_ids(src: Path, max_tokens: int = 512, seed: int = 0) -> tuple[torch.Tensor, str]:
    config = json.loads((src / "config.json").read_text())
    text_config = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    vocab = config.get("vocab_size") or text_config.get("vocab_size")
    positions = config.get("max_position_embeddings") or text_config.get("max_position_embeddings")
    if isinstance(positions, int) and positions > 1:  # learned position tables end there
        max_tokens = min(max_tokens, positions)
    if any((src / f).exists() for f in TOKENIZER_FILES):
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(src)
        except Exception as e:  # noqa: BLE001 - which error depends on the files present and the packages installed
            raise Fp8kitError(f"{src}: its tokenizer does not load ({type(e).__name__}: {first_line(e)}); fix the "
                              f"tokenizer files ({', '.join(f for f in TOKENIZER_FILES if (src / f).exists())})") from e
        try:
            ids = tokenizer(SAMPLE.read_text(), return_tensors="pt").input_ids[:, :max_tokens]
        except Exception as e:  # noqa: BLE001 - a tokenizer that loads but cannot encode (a broken normalizer, say)
            raise Fp8kitError(f"{src}: its tokenizer loads but fails on the validation sample ({type(e).__name__}: "
                              f"{first_line(e)}); fix the tokenizer files") from e
        if isinstance(vocab, int) and ids.numel() and int(ids.max()) >= vocab:  # an IndexError in the embedding
            raise Fp8kitError(f"{src}: its tokenizer gives token id {int(ids.max())}, past the model's vocab_size "
                              f"{vocab}; the tokenizer files and the weights do not belong together")
        return ids, "text sample"
    ids = torch.randint(0, vocab, (1, max_tokens), generator=torch.Generator().manual_seed(seed))
    return ids, f"random token ids (seed {seed}; the source has no tokenizer)"


def _logits(path: Path, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    with quiet(), torch.no_grad():
        model = load_causal_lm(path, dtype)
        logits = model(input_ids=ids).logits.float()
    del model
    gc.collect()
    return logits


def validate(src: str | Path, fp8: str | Path, dtype: torch.dtype = torch.float32, max_tokens: int = 512,
             sample: tuple[torch.Tensor, str] | None = None) -> dict:
    """One model at a time in memory: the source's logits first, then the FP8 model's. `sample`: sample_ids(src)'s
    answer when the caller has it already (publish reads the tokenizer before converting: a broken one is named
    before the work, not after)."""
    src, fp8 = Path(src), Path(fp8)
    ids, tokens = sample if sample is not None else sample_ids(src, max_tokens)
    ref = _logits(src, ids, dtype)
    got = _logits(fp8, ids, dtype)
    drift = logit_drift(ref, got)
    return {"kl": drift["kl"], "top1": drift["top1"], "ppl_ratio": perplexity(got, ids) / perplexity(ref, ids),
            "tokens": int(ids.numel()), "token_source": tokens}
