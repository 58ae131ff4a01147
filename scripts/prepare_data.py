"""Tokenize local text files into the token file that `data.kind=memmap` trains on.

    python scripts/prepare_data.py --out data/tokens.bin input1.txt input2.txt
    python scripts/prepare_data.py --out data/tokens.bin --tokenizer path/tokenizer.json input.txt

Each input file is one document, followed by an end-of-document token. The default tokenizer is
byte-level with vocabulary 256 (the `tiny` model's): tokens are the UTF-8 bytes of the file and
byte 0 (NUL, which text does not contain) is the separator. `--tokenizer` takes a local Hugging
Face `tokenizer.json` (needs the `tokenizers` package; nothing is downloaded); the separator is its
end-of-text token, found by name or given with `--eos-token`. The ids go to a flat uint16 file
(vocabularies up to 65536) or uint32, with a sidecar `<out>.json` that training checks.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from fsdp_offload.data import token_dtype, write_token_file

BYTE_VOCAB = 256
BYTE_EOS = 0
CHUNK_BYTES = 16 << 20  # the byte tokenizer streams files in chunks of this size
EOS_NAMES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "[SEP]")


def byte_documents(files: list[Path]) -> Iterator[np.ndarray]:
    """UTF-8 bytes of each file, chunk by chunk, then the NUL separator."""
    for path in files:
        offset = 0
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK_BYTES):
                ids = np.frombuffer(chunk, dtype=np.uint8)
                nul = np.flatnonzero(ids == BYTE_EOS)
                if nul.size:
                    raise ValueError(
                        f"{path} has a NUL byte at offset {offset + int(nul[0])}: the byte "
                        "tokenizer keeps byte 0 as the document separator; is it a text file?"
                    )
                offset += len(chunk)
                yield ids
        yield np.array([BYTE_EOS], dtype=np.uint8)


def load_tokenizer(path: Path, eos_token: str | None):
    """A local tokenizer.json and its end-of-text id."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ImportError(
            f"--tokenizer {path} needs the `tokenizers` package: pip install tokenizers "
            "(or leave out --tokenizer for the byte tokenizer)"
        ) from None
    if not path.is_file():
        raise FileNotFoundError(f"--tokenizer {path} does not exist; pass a local tokenizer.json")
    tok = Tokenizer.from_file(str(path))
    names = (eos_token,) if eos_token else EOS_NAMES
    for name in names:
        if (eos_id := tok.token_to_id(name)) is not None:
            return tok, name, eos_id
    raise ValueError(
        f"--tokenizer {path} has no end-of-text token named {' or '.join(names)}; "
        "name it with --eos-token"
    )


def tokenizer_documents(files: list[Path], tok, eos_id: int) -> Iterator[np.ndarray]:
    for path in files:
        text = path.read_text(encoding="utf-8")
        # No BOS/EOS from the tokenizer's post-processor: the one separator is ours.
        yield np.asarray(tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)
        yield np.array([eos_id], dtype=np.int64)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="token file to write")
    parser.add_argument("--tokenizer", type=Path, help="local tokenizer.json (default: bytes)")
    parser.add_argument("--eos-token", help="the tokenizer's end-of-text token, if unusual")
    parser.add_argument("inputs", type=Path, nargs="+", help="UTF-8 text files, one document each")
    args = parser.parse_args(argv)

    for path in args.inputs:
        if not path.is_file():
            raise FileNotFoundError(f"input {path} does not exist")
    if args.tokenizer is None:
        if args.eos_token is not None:
            raise ValueError(
                "--eos-token needs --tokenizer; the byte tokenizer's separator is byte 0"
            )
        vocab_size, name, eos_id = BYTE_VOCAB, "bytes", BYTE_EOS
        documents = byte_documents(args.inputs)
    else:
        tok, eos_name, eos_id = load_tokenizer(args.tokenizer, args.eos_token)
        vocab_size, name = tok.get_vocab_size(with_added_tokens=True), str(args.tokenizer.resolve())
        documents = tokenizer_documents(args.inputs, tok, eos_id)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    num_tokens = write_token_file(args.out, documents, vocab_size, name, eos_id)
    dtype = token_dtype(vocab_size)
    eos = "byte 0" if args.tokenizer is None else f"{eos_name!r} = {eos_id}"
    print(
        f"wrote {args.out}: {num_tokens:,} tokens ({dtype}, vocab {vocab_size}, tokenizer {name}, "
        f"eos {eos}) from {len(args.inputs)} files; train with data.kind=memmap "
        f"data.path={args.out} data.dtype={dtype}"
    )


if __name__ == "__main__":
    main()
