"""Tokenizers from local files: a tokenizer.json (Hugging Face `tokenizers`) or a directory
saved with save_pretrained (`transformers.AutoTokenizer`, local files only), as `lowband prepare`,
`lowband train --tokenizer` and `lowband export` read them. tokenizers and transformers load
lazily: lowband imports without the hf extra."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from lowband.options import ConfigError, needs_extra

EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[EOS]")


@dataclass
class TokenizerRef:
    path: Path
    sha256: str
    json: str  # the tokenizers.Tokenizer, serialized: what the workers load
    vocab_size: int
    eos_id: int | None


def tokenizer_files(path: Path) -> list[tuple[str, Path]]:
    """(name, file) of a tokenizer: a lone file counts as tokenizer.json."""
    if path.is_file():
        return [("tokenizer.json", path)]
    return sorted((p.name, p) for p in path.iterdir() if p.is_file() and not p.name.startswith("."))


def tokenizer_sha256(path: Path) -> str:
    h = hashlib.sha256()
    for name, p in tokenizer_files(path):
        data = p.read_bytes()
        h.update(f"{name}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


_FIX = "give a tokenizer.json file or a directory saved with save_pretrained"


def existing(path: str) -> Path:
    if not Path(path).exists():
        raise ConfigError(f"tokenizer '{path}' does not exist: {_FIX}.")
    return Path(path)


def load_tokenizer(path: str) -> TokenizerRef:
    p = existing(path)
    lone = p.is_file() or ((p / "tokenizer.json").exists() and not (p / "tokenizer_config.json").exists())
    needs_extra("hf", "--tokenizer", "tokenizers" if lone else "transformers")
    try:
        if lone:
            from tokenizers import Tokenizer

            tok, eos = Tokenizer.from_file(str(p if p.is_file() else p / "tokenizer.json")), None
        else:
            from transformers import AutoTokenizer

            hf = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
            tok, eos = hf.backend_tokenizer, hf.eos_token_id
    except Exception as e:
        why = (str(e).strip().splitlines() or [""])[0][:160].rstrip(".")
        raise ConfigError(f"tokenizer '{path}' does not load ({type(e).__name__}: {why}): {_FIX}.") from None
    if eos is None:
        eos = next((i for i, t in sorted(tok.get_added_tokens_decoder().items())
                    if t.special and t.content in EOS_NAMES), None)
    vocab = max(tok.get_vocab(with_added_tokens=True).values()) + 1
    return TokenizerRef(p.resolve(), tokenizer_sha256(p), tok.to_str(), vocab, eos)
