"""Training a tokenizer (`jaxlm tokenizer train`): a byte-level BPE with Hugging Face `tokenizers`, written as a
folder that transformers and `--tokenizer DIR` load as they are."""

from __future__ import annotations

import json
from pathlib import Path

from jaxlm.data.tokenizer import TokenizerError


def train_bpe(inputs: list[str], vocab_size: int, out_dir: str | Path, field: str = "text",
              special_tokens: tuple[str, ...] = ("<|endoftext|>",), per_line: bool = False) -> Path:
    """Train a byte-level BPE (Hugging Face `tokenizers`) on the texts of `inputs` (any sources.py input) and
    write tokenizer.json plus a tokenizer_config.json naming the first special token as EOS, a folder that
    transformers' PreTrainedTokenizerFast and `--tokenizer DIR` load as they are. Returns the folder."""
    try:
        from tokenizers import Tokenizer as RustTokenizer, decoders, models, pre_tokenizers, processors, trainers
    except ImportError:
        raise TokenizerError("tokenizer training needs the tokenizers package: pip install 'jaxlm[data]'") from None
    from jaxlm.data import sources

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + len(special_tokens):
        raise TokenizerError(f"--vocab-size {vocab_size} is too small for a byte-level BPE: at least "
                             f"{len(alphabet) + len(special_tokens)} (256 bytes + special tokens)")
    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special_tokens),
                                  initial_alphabet=alphabet, show_progress=False)
    texts = (text for text, _ in sources.texts(inputs, field, per_line=per_line))
    tok.train_from_iterator(texts, trainer=trainer)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    eos = special_tokens[0] if special_tokens else None
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 30, "eos_token": eos,
              "bos_token": None, "unk_token": None, "pad_token": None, "clean_up_tokenization_spaces": False}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return out
