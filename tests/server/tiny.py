"""A tiny Mixtral checkpoint with a byte-level tokenizer and a ChatML template, for server tests.

The tokenizer is built offline with `tokenizers`: ids 0..255 are the bytes, 256.. specials.
"""

from __future__ import annotations

from pathlib import Path

from tests.models.families import FAMILIES

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB = 256 + len(SPECIALS)
EOS = 256 + SPECIALS.index("<|im_end|>")


def save_byte_tokenizer(path: Path, chat_template: str = CHATML) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=lambda c: _byte_of(c))
    vocab = {c: i for i, c in enumerate(byte_chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=chat_template,
    )
    fast.save_pretrained(str(path))


def _byte_of(ch: str) -> int:
    """Inverse of GPT-2's bytes_to_unicode for one character."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1))
    bs += list(range(0xAE, 0xFF + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(cs, bs))[ord(ch)]


def make_tiny_server_model(
    path: Path, max_position_embeddings: int = 256, chat_template: str = CHATML
) -> Path:
    FAMILIES["mixtral"].checkpoint(
        path,
        vocab_size=VOCAB,
        eos_token_id=EOS,
        bos_token_id=256,
        max_position_embeddings=max_position_embeddings,
    )
    save_byte_tokenizer(path, chat_template)
    return path
