"""Token batches for the training recipes: a learnable synthetic stream, or a memmapped token file.

Both kinds are one global, deterministic stream of samples (windows of `seq_len + 1` tokens:
inputs plus the shifted targets) numbered n = 0, 1, 2, ... Each micro-batch (each `next()`)
consumes `world_size * micro_batch` consecutive samples, rank r taking the r-th run of `micro_batch` of
them; an optimizer step takes `train.micro_batches` of those.
So the whole state is one integer, `position` (global samples consumed so far), equal on every
rank: a resumed run sees exactly the batches an uninterrupted one would, and a global batch does
not depend on how it is split over ranks (1 rank x 4 samples == 2 ranks x 2 samples).

The token file, written by `write_token_file` (`scripts/prepare_data.py` calls it): a flat array of
uint16 (vocabularies up to 65536 ids) or uint32 token ids, no header, plus a sidecar `<file>.json`
{"dtype", "vocab_size", "num_tokens", "tokenizer", "eos_id"} that TokenBatches checks against the
config when it exists. The default byte tokenizer has vocabulary 256 (the `tiny` model's): tokens
are UTF-8 bytes and byte 0 (NUL, absent from text) separates documents.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .job_errors import job_wide

TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
# Successors per token in the synthetic Markov chain: the best loss it allows is ln(4) = 1.386 nats.
SYNTHETIC_BRANCHING = 4
# Tokens checked against the vocabulary when a file is opened (every batch is checked again later).
_SCAN_TOKENS = 1 << 20


@dataclass
class DataConfig:
    # "synthetic": a seeded, learnable Markov chain over the model's vocabulary;
    # "memmap": a token file.
    kind: str = "synthetic"
    # kind=memmap: the token file written by scripts/prepare_data.py.
    path: str | None = None
    # Token dtype of the file: "uint16" or "uint32" (prepare_data picks it; see <path>.json).
    dtype: str = "uint16"
    # Tokens per sample fed to the model; a sample holds seq_len + 1 (targets are shifted by 1).
    seq_len: int = 128
    # Samples per rank per step.
    micro_batch: int = 2
    # Seeds the synthetic chain, or the shuffled order of the file's windows (new each epoch).
    seed: int = 0


def token_dtype(vocab_size: int) -> str:
    """The smallest file dtype that holds every id of a vocabulary."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def sidecar_path(path: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(path)}.json")


def write_sidecar(
    path: str | os.PathLike, vocab_size: int, num_tokens: int, tokenizer: str, eos_id: int
) -> None:
    meta = {
        "dtype": token_dtype(vocab_size),
        "vocab_size": vocab_size,
        "num_tokens": num_tokens,
        "tokenizer": tokenizer,
        "eos_id": eos_id,
    }
    sidecar_path(path).write_text(json.dumps(meta, indent=1) + "\n")


def write_token_file(
    path: str | os.PathLike,
    tokens: np.ndarray | Iterable[np.ndarray],
    vocab_size: int,
    tokenizer: str,
    eos_id: int,
) -> int:
    """Writes token ids (one array, or chunks of them streamed) as a token file with its sidecar;
    returns the token count. The file is written beside `path` and renamed, so a failure (a bad
    id, or one from whatever yields the chunks) leaves no half file under the real name."""
    path = Path(path)
    dtype = TOKEN_DTYPES[token_dtype(vocab_size)]
    tmp = path.with_name(path.name + ".tmp")
    num_tokens = 0
    try:
        with open(tmp, "wb") as f:
            for ids in [tokens] if isinstance(tokens, np.ndarray) else tokens:
                if ids.size and int(ids.max()) >= vocab_size:
                    raise ValueError(f"token id {int(ids.max())} >= vocab_size {vocab_size}")
                f.write(ids.astype(dtype).tobytes())
                num_tokens += ids.size
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    write_sidecar(path, vocab_size, num_tokens, tokenizer, eos_id)
    return num_tokens


class TokenBatches(Iterator[torch.Tensor]):
    """Endless int64 batches of shape (micro_batch, seq_len + 1) for one data-parallel rank.

    `state_dict()` / `load_state_dict()` save and restore the position (DCP Stateful); every rank
    holds the same state. `vocab_size` is the model's: token ids must be below it.
    """

    @job_wide  # the same data on every rank: rank 0 says what is wrong with it
    def __init__(self, cfg: DataConfig, vocab_size: int, rank: int = 0, world_size: int = 1):
        if cfg.kind not in ("synthetic", "memmap"):
            raise ValueError(f"unknown data.kind={cfg.kind!r}; use 'synthetic' or 'memmap'")
        if cfg.dtype not in TOKEN_DTYPES:
            raise ValueError(f"unknown data.dtype={cfg.dtype!r}; use 'uint16' or 'uint32'")
        if cfg.seq_len < 1 or cfg.micro_batch < 1:
            raise ValueError(
                f"data.seq_len={cfg.seq_len} and data.micro_batch={cfg.micro_batch} must be >= 1"
            )
        if vocab_size < 2:
            raise ValueError(f"vocab_size={vocab_size} must be >= 2")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} is not in [0, world_size={world_size})")
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.rank = rank
        self.world_size = world_size
        self.position = 0  # global samples consumed by all ranks
        self.window = cfg.seq_len + 1
        if cfg.kind == "synthetic":
            if cfg.path is not None:
                raise ValueError(
                    f"data.path={cfg.path} is set but data.kind=synthetic would ignore it; "
                    "set data.kind=memmap to train on the file, or data.path=null"
                )
            # Each token has SYNTHETIC_BRANCHING likely successors, fixed by the seed.
            table_rng = np.random.default_rng([cfg.seed, 0])
            self._successors = table_rng.integers(0, vocab_size, (vocab_size, SYNTHETIC_BRANCHING))
            self.num_tokens = 0
            self.fingerprint = None
        else:
            self._tokens = self._open(cfg, vocab_size, world_size)
            self.num_tokens = len(self._tokens)
            self.fingerprint = _fingerprint(Path(cfg.path))
            self.num_windows = self.num_tokens // self.window
            self._epoch = -1
            self._order = np.empty(0, dtype=np.int64)

    @staticmethod
    def _open(cfg: DataConfig, vocab_size: int, world_size: int) -> np.ndarray:
        if cfg.path is None:
            raise ValueError(
                "data.kind=memmap needs data.path: a token file from scripts/prepare_data.py"
            )
        path = Path(cfg.path)
        if not path.is_file():
            raise FileNotFoundError(
                f"data.path={path} does not exist; make it with "
                f"`python scripts/prepare_data.py --out {path} <text files>`"
            )
        itemsize = np.dtype(TOKEN_DTYPES[cfg.dtype]).itemsize
        nbytes = path.stat().st_size
        if nbytes % itemsize:
            raise ValueError(
                f"data.path={path} is {nbytes} bytes, not a multiple of {itemsize} "
                f"(data.dtype={cfg.dtype}); wrong data.dtype?"
            )
        num_tokens = nbytes // itemsize
        meta_path = sidecar_path(path)
        if meta_path.is_file():
            meta = json.loads(meta_path.read_text())
            if meta["dtype"] != cfg.dtype:
                raise ValueError(
                    f"data.dtype={cfg.dtype} but {meta_path} says the file is {meta['dtype']}; "
                    f"set data.dtype={meta['dtype']}"
                )
            if meta["num_tokens"] != num_tokens:
                raise ValueError(
                    f"{meta_path} says {meta['num_tokens']} tokens but data.path={path} holds "
                    f"{num_tokens}; the file was changed after prepare_data, re-run it"
                )
            if meta["vocab_size"] > vocab_size:
                raise ValueError(
                    f"data.path={path} was tokenized with {meta['tokenizer']} (vocab "
                    f"{meta['vocab_size']}) but the model's vocab_size is {vocab_size}; use a "
                    "model whose vocab_size covers it, or re-run prepare_data with the model's "
                    "tokenizer"
                )
        need = world_size * cfg.micro_batch * (cfg.seq_len + 1)
        if num_tokens < need:
            raise ValueError(
                f"data.path={path} holds {num_tokens} tokens, fewer than one step needs: "
                f"world_size {world_size} x data.micro_batch {cfg.micro_batch} x "
                f"(data.seq_len {cfg.seq_len} + 1) = {need}; add text, or lower data.seq_len "
                "or data.micro_batch"
            )
        tokens = np.memmap(path, dtype=TOKEN_DTYPES[cfg.dtype], mode="r")
        _check_ids(tokens[:_SCAN_TOKENS], 0, vocab_size, path)
        return tokens

    def samples(self, first: int, count: int) -> np.ndarray:
        """Samples first .. first + count - 1 of the global stream: (count, seq_len + 1) int64."""
        ns = range(first, first + count)
        if self.cfg.kind == "synthetic":
            # One generator per sample, so a sample does not depend on the batch it lands in.
            rngs = [np.random.default_rng([self.cfg.seed, 1, n]) for n in ns]
            out = np.empty((count, self.window), dtype=np.int64)
            out[:, 0] = [rng.integers(0, self.vocab_size) for rng in rngs]
            choices = np.stack(
                [rng.integers(0, SYNTHETIC_BRANCHING, self.cfg.seq_len) for rng in rngs]
            )
            for t in range(self.cfg.seq_len):
                out[:, t + 1] = self._successors[out[:, t], choices[:, t]]
            return out
        return np.stack([self._window(n) for n in ns])

    def _window(self, n: int) -> np.ndarray:
        epoch, i = divmod(n, self.num_windows)
        if epoch != self._epoch:  # a fresh shuffle of the window starts each epoch
            rng = np.random.default_rng([self.cfg.seed, 2, epoch])
            self._order = rng.permutation(self.num_windows)
            self._epoch = epoch
        start = int(self._order[i]) * self.window
        out = np.asarray(self._tokens[start : start + self.window], dtype=np.int64)
        # Embedding lookups fail obscurely (a device assert on GPU) on a bad id: name it here.
        _check_ids(out, start, self.vocab_size, Path(str(self.cfg.path)))
        return out

    def batch_at(self, position: int) -> torch.Tensor:
        """This rank's batch of the step that starts at global sample `position`."""
        first = position + self.rank * self.cfg.micro_batch
        return torch.from_numpy(self.samples(first, self.cfg.micro_batch))

    def __next__(self) -> torch.Tensor:
        batch = self.batch_at(self.position)
        self.position += self.world_size * self.cfg.micro_batch
        return batch

    def state_dict(self) -> dict:
        # What else fixes the stream is kept too: a resume that would see other data fails loudly.
        return {
            "position": self.position,
            "kind": self.cfg.kind,
            "seed": self.cfg.seed,
            "seq_len": self.cfg.seq_len,
            "num_tokens": self.num_tokens,
            "fingerprint": self.fingerprint,
        }

    @job_wide
    def load_state_dict(self, state: dict) -> None:
        for key in ("kind", "seed", "seq_len", "num_tokens"):
            mine = self.num_tokens if key == "num_tokens" else getattr(self.cfg, key)
            if state[key] != mine:
                where = "the token file's length" if key == "num_tokens" else f"data.{key}"
                raise ValueError(
                    f"checkpoint was taken with {key}={state[key]} but {where} is now {mine}; "
                    "resume with the same data settings (the stream would differ)"
                )
        if state.get("fingerprint", self.fingerprint) != self.fingerprint:  # (a checkpoint from before it: not kept)
            raise ValueError(
                f"data.path={self.cfg.path} holds other tokens than the checkpoint was trained on (the same length, "
                "other bytes at its start or end); resume with the token file it was trained on"
            )
        position = state["position"]
        if isinstance(position, bool) or not isinstance(position, int) or position < 0:
            raise ValueError(f"checkpoint's data position {position!r} is not a whole number >= 0: the checkpoint is damaged; resume from an older one")
        self.position = position


def _fingerprint(path: Path) -> str:
    """A digest of the token file's first and last MiB: another file of the same length differs there
    (reading all of a large file at every start would not pay)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        digest.update(f.read(1 << 20))
        f.seek(max(0, path.stat().st_size - (1 << 20)))
        digest.update(f.read(1 << 20))
    return digest.hexdigest()


def _check_ids(tokens: np.ndarray, offset: int, vocab_size: int, path: Path) -> None:
    if tokens.size == 0:
        return
    bad = np.flatnonzero(tokens >= vocab_size)
    if bad.size:
        at = offset + int(bad[0])
        raise ValueError(
            f"data.path={path}: token {at} has id {int(tokens[bad[0]])} >= the model's "
            f"vocab_size {vocab_size}; wrong tokenizer or model? re-run prepare_data with the "
            "model's tokenizer"
        )
