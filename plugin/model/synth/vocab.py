"""Tokenizers for synthetic models.

By default a small byte-level BPE vocabulary is built here from a fixed corpus, so tiny test
models stay small and need no file from elsewhere. `--vocab FILE` copies the tokenizer of a
vocab-only GGUF instead (for example llama.cpp's `models/ggml-vocab-qwen2.gguf`).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# llama.cpp token types (llama_token_type)
TOKEN_NORMAL = 1
TOKEN_CONTROL = 3

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# The text the merges are learned from: a little English and a little code, so that common
# words and keywords become single tokens, as in a real vocabulary.
CORPUS = """
The quick brown fox jumps over the lazy dog. A mixture of experts routes every token to a few
experts out of many; the router picks them, and the chosen experts are computed and summed.
Hello, how are you today? I would like to know what the weather will be like tomorrow.
Please write a short story about a robot who learns to paint, and explain why it matters.
def main(argv: list[str]) -> int:
    for index, value in enumerate(argv):
        if value == "--help":
            print("usage: main [--help]")
            return 0
    return 1
class Cache:
    def __init__(self, size: int) -> None:
        self.size = size
        self.items = {}
    def get(self, key):
        return self.items.get(key)
int main(int argc, char ** argv) { for (int i = 0; i < argc; ++i) { printf("%s\\n", argv[i]); } return 0; }
function add(a, b) { return a + b; } const result = add(1, 2); console.log(result);
SELECT name, count(*) FROM users WHERE age > 30 GROUP BY name ORDER BY name;
The model answered the question, and then the user asked another question about the answer.
"""

_PRETOKEN_RE = re.compile(r" ?[A-Za-z]+| ?[0-9]| ?[^\sA-Za-z0-9]+|\s+")


@dataclass
class Vocab:
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    bos_id: int
    eos_id: int
    model: str = "gpt2"
    pre: str = "qwen2"
    chat_template: str | None = CHATML_TEMPLATE
    raw_fields: list[tuple[str, Any, Any, Any]] | None = None  # copied verbatim from a vocab GGUF

    def __len__(self) -> int:
        return len(self.tokens)


def byte_to_unicode() -> dict[int, str]:
    """The byte-level BPE alphabet: every byte as one printable character.

    Printable Latin-1 bytes stand for themselves; the others are shifted above U+0100 so that
    no token contains whitespace or control characters.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table: dict[int, str] = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shift)
            shift += 1
    return table


def _learn_merges(corpus: str, n_merges: int) -> list[tuple[str, str]]:
    """Plain BPE training; ties go to the lexicographically smallest pair, so it is deterministic."""
    alphabet = byte_to_unicode()
    words: Counter[tuple[str, ...]] = Counter()
    for piece in _PRETOKEN_RE.findall(corpus):
        words[tuple(alphabet[b] for b in piece.encode("utf-8"))] += 1
    merges: list[tuple[str, str]] = []
    for _ in range(n_merges):
        pairs: Counter[tuple[str, str]] = Counter()
        for word, count in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += count
        if not pairs:
            break
        best = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))[0]
        merges.append(best)
        merged: Counter[tuple[str, ...]] = Counter()
        for word, count in words.items():
            out: list[str] = []
            i = 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(word[i] + word[i + 1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += count
        words = merged
    return merges


def builtin_vocab(n_vocab: int | None = None, n_merges: int = 256) -> Vocab:
    """A byte-level BPE vocab: 256 bytes, learned merges, ChatML specials, optional padding.

    `n_vocab` pads with never-produced tokens up to a real model's size (the benchmark shape
    needs 151936 so that the output layer costs what it costs in the real model).
    """
    tokens = list(byte_to_unicode().values())
    merges = _learn_merges(CORPUS, n_merges)
    seen = set(tokens)
    for left, right in merges:
        if left + right not in seen:
            tokens.append(left + right)
            seen.add(left + right)
    types = [TOKEN_NORMAL] * len(tokens)
    specials_at = len(tokens)
    tokens += list(SPECIAL_TOKENS)
    types += [TOKEN_CONTROL] * len(SPECIAL_TOKENS)
    if n_vocab is not None:
        if n_vocab < len(tokens):
            raise ValueError(f"--vocab-size {n_vocab} is below the built-in vocabulary's {len(tokens)} tokens")
        tokens += [f"[extra_{i}]" for i in range(n_vocab - len(tokens))]
        types += [TOKEN_NORMAL] * (n_vocab - len(types))
    return Vocab(
        tokens=tokens,
        token_types=types,
        merges=[f"{a} {b}" for a, b in merges],
        bos_id=specials_at,  # <|endoftext|>
        eos_id=specials_at + 2,  # <|im_end|>
    )


def vocab_from_gguf(path: Path) -> Vocab:
    """Every tokenizer.* key of a vocab-only GGUF, to be copied verbatim."""
    import gguf
    from gguf import GGUFValueType

    reader = gguf.GGUFReader(path)
    fields: list[tuple[str, Any, Any, Any]] = []
    tokens: list[str] | None = None
    for key, f in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == GGUFValueType.ARRAY else None
        value = f.contents()
        fields.append((key, value, vtype, sub))
        if key == "tokenizer.ggml.tokens":
            tokens = list(value)
    if tokens is None:
        raise ValueError(f"{path}: no tokenizer.ggml.tokens: not a vocab GGUF")
    return Vocab(tokens=tokens, token_types=[], merges=[], bos_id=-1, eos_id=-1, raw_fields=fields)


def add_vocab_to_writer(writer: Any, vocab: Vocab) -> None:
    from gguf import GGUFValueType

    if vocab.raw_fields is not None:
        for key, value, vtype, sub in vocab.raw_fields:
            writer.add_key_value(key, value, vtype, sub_type=sub)
        if not any(key == "tokenizer.ggml.add_bos_token" for key, *_ in vocab.raw_fields):
            writer.add_bool("tokenizer.ggml.add_bos_token", False)
        return
    writer.add_tokenizer_model(vocab.model)
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.token_types)
    writer.add_token_merges(vocab.merges)
    writer.add_bos_token_id(vocab.bos_id)
    writer.add_eos_token_id(vocab.eos_id)
    writer.add_pad_token_id(vocab.bos_id)
    writer.add_key_value("tokenizer.ggml.add_bos_token", False, GGUFValueType.BOOL)
    if vocab.chat_template:
        writer.add_chat_template(vocab.chat_template)
