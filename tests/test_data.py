"""Token batches: determinism, exact resume, disjoint ranks, learnable synthetic data, bad input,
and scripts/prepare_data.py end to end."""

import dataclasses
import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fsdp_offload.data import DataConfig, TokenBatches, sidecar_path, write_token_file
from fsdp_offload.models import MODEL_PRESETS, Transformer

REPO = Path(__file__).resolve().parents[1]


def load_prepare_data():
    spec = importlib.util.spec_from_file_location("prepare_data", REPO / "scripts/prepare_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


prepare_data = load_prepare_data()


def counting_file(tmp_path: Path, n: int) -> tuple[DataConfig, int]:
    """Token i has id i, so a window's first id is its start offset."""
    path = tmp_path / "tokens.bin"
    write_token_file(path, np.arange(n), vocab_size=n, tokenizer="counting", eos_id=0)
    return DataConfig(kind="memmap", path=str(path), seq_len=7, micro_batch=2), n


def take(batches: TokenBatches, steps: int) -> list[torch.Tensor]:
    return [next(batches) for _ in range(steps)]


@pytest.mark.parametrize("kind", ["synthetic", "memmap"])
def test_deterministic_shape_and_resume(tmp_path, kind):
    if kind == "memmap":
        cfg, vocab = counting_file(tmp_path, 200)  # 25 windows: 5 steps per epoch at 2 x 2
    else:
        cfg, vocab = DataConfig(seq_len=16, micro_batch=2, seed=3), 256
    run = take(TokenBatches(cfg, vocab, rank=1, world_size=2), 12)
    again = take(TokenBatches(cfg, vocab, rank=1, world_size=2), 12)
    assert all(torch.equal(a, b) for a, b in zip(run, again))
    assert run[0].shape == (2, cfg.seq_len + 1) and run[0].dtype == torch.int64
    assert not torch.equal(run[0], run[1])

    # Stop after 7 steps (past an epoch boundary for memmap), resume in a fresh object.
    first = TokenBatches(cfg, vocab, rank=1, world_size=2)
    take(first, 7)
    state = first.state_dict()
    resumed = TokenBatches(cfg, vocab, rank=1, world_size=2)
    resumed.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(run[7:], take(resumed, 5)))


def test_global_batch_does_not_depend_on_world_size():
    one = TokenBatches(DataConfig(micro_batch=4, seq_len=8), 256)
    two = [TokenBatches(DataConfig(micro_batch=2, seq_len=8), 256, r, 2) for r in range(2)]
    for _ in range(3):
        assert torch.equal(next(one), torch.cat([next(b) for b in two]))


def test_seed_changes_synthetic_stream():
    a = next(TokenBatches(DataConfig(seed=0), 256))
    b = next(TokenBatches(DataConfig(seed=1), 256))
    assert not torch.equal(a, b)


def test_ranks_take_disjoint_windows_covering_an_epoch(tmp_path):
    cfg, vocab = counting_file(tmp_path, 8 * 10 + 5)  # 10 windows of 8, an unused tail
    cfg = dataclasses.replace(cfg, micro_batch=1)
    ranks = [TokenBatches(cfg, vocab, r, 2) for r in range(2)]
    starts = []
    for _ in range(5):  # one epoch: 10 windows, 2 per step
        for b in ranks:
            rows = next(b)
            assert torch.equal(rows - rows[:, :1], torch.arange(8).expand_as(rows))  # contiguous
            starts += rows[:, 0].tolist()
    assert sorted(starts) == list(range(0, 80, 8))  # each window once, over both ranks
    assert starts != sorted(starts)  # shuffled
    # The next epoch is another order of the same windows.
    nxt = [next(b)[0, 0].item() for _ in range(5) for b in ranks]
    assert sorted(nxt) == list(range(0, 80, 8)) and nxt != starts


def conditional_entropy(tokens: np.ndarray, vocab: int) -> tuple[float, float]:
    """Plug-in H(next) and H(next | previous) in nats."""
    pairs = np.zeros((vocab, vocab))
    np.add.at(pairs, (tokens[:, :-1].ravel(), tokens[:, 1:].ravel()), 1)
    p = pairs / pairs.sum()
    marginal = p.sum(0)
    h_next = -np.sum(marginal[marginal > 0] * np.log(marginal[marginal > 0]))
    rows = p.sum(1, keepdims=True)
    cond = np.where(p > 0, p / np.maximum(rows, 1e-30), 1.0)
    return float(h_next), float(-np.sum(p * np.log(cond)))


def test_synthetic_is_learnable():
    batches = TokenBatches(DataConfig(seq_len=128, micro_batch=8), 256)
    tokens = torch.cat(take(batches, 8)).numpy()
    h_next, h_cond = conditional_entropy(tokens, 256)
    assert h_next > 5.0  # nearly uniform over 256 ids (ln 256 = 5.55)
    assert h_cond < math.log(4) + 0.05  # but only ~4 successors per token

    # And the tiny model's loss falls well within a few dozen steps.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: threads add only overhead, and contend on a busy box
    try:
        losses = train_tiny(steps=40)
    finally:
        torch.set_num_threads(threads)
    # From ln(256) = 5.5 to near 2 (the floor is ln 4 = 1.39); learning nothing stays > 5.
    assert losses[0] > 5.0 and sum(losses[-5:]) / 5 < 3.0, losses


def train_tiny(steps: int) -> list[float]:
    torch.manual_seed(0)
    model = Transformer(MODEL_PRESETS["tiny"])
    model.init_weights()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = TokenBatches(DataConfig(seq_len=64, micro_batch=8), 256)
    losses = []
    for _ in range(steps):
        x = next(batches)
        loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


# ---- bad input: one line that names the option and the fix ---------------------------------


def memmap_cfg(path: Path, **changes) -> DataConfig:
    return DataConfig(kind="memmap", path=str(path), seq_len=7, micro_batch=2, **changes)


def test_unknown_kind_and_dtype():
    with pytest.raises(ValueError, match="data.kind='hf'"):
        TokenBatches(DataConfig(kind="hf"), 256)
    with pytest.raises(ValueError, match="data.dtype='int8'.*'uint16' or 'uint32'"):
        TokenBatches(DataConfig(dtype="int8"), 256)


def test_path_and_kind_must_agree(tmp_path):
    with pytest.raises(ValueError, match="kind=synthetic would ignore it; set data.kind=memmap"):
        TokenBatches(DataConfig(path=str(tmp_path / "x.bin")), 256)
    with pytest.raises(ValueError, match="data.kind=memmap needs data.path"):
        TokenBatches(DataConfig(kind="memmap"), 256)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist; make it with .*prepare_data.py"):
        TokenBatches(memmap_cfg(tmp_path / "nope.bin"), 256)


def test_size_not_a_multiple_of_dtype(tmp_path):
    path = tmp_path / "odd.bin"
    path.write_bytes(bytes(6 * 32 + 2))
    with pytest.raises(ValueError, match="194 bytes, not a multiple of 4 .data.dtype=uint32."):
        TokenBatches(memmap_cfg(path, dtype="uint32"), 256)


def test_file_too_short(tmp_path):
    path = tmp_path / "short.bin"
    write_token_file(path, np.ones(31, dtype=np.int64), 256, "bytes", 0)
    need = r"holds 31 tokens.*2 x data.micro_batch 2 x .data.seq_len 7 \+ 1. = 32"
    with pytest.raises(ValueError, match=need):
        TokenBatches(memmap_cfg(path), 256, rank=0, world_size=2)
    TokenBatches(memmap_cfg(path), 256)  # one rank needs only 16


def test_token_out_of_vocab(tmp_path):
    path = tmp_path / "big.bin"
    tokens = np.ones(100, dtype=np.uint16)
    tokens[37] = 300
    tokens.tofile(path)  # no sidecar: the scan of the first tokens must catch it
    with pytest.raises(ValueError, match="token 37 has id 300 >= the model's vocab_size 256"):
        TokenBatches(memmap_cfg(path), 256)


def test_token_out_of_vocab_past_the_scan(tmp_path, monkeypatch):
    monkeypatch.setattr("fsdp_offload.data._SCAN_TOKENS", 8)
    path = tmp_path / "big.bin"
    tokens = np.ones(16, dtype=np.uint16)
    tokens[12] = 999
    tokens.tofile(path)
    batches = TokenBatches(dataclasses.replace(memmap_cfg(path), micro_batch=1), 256)
    with pytest.raises(ValueError, match="token 12 has id 999"):
        take(batches, 2)  # both windows: the bad one is read within the epoch


def test_sidecar_disagrees_with_config(tmp_path):
    path = tmp_path / "t.bin"
    write_token_file(path, np.arange(64) % 50, 50_000, "tok.json", 2)  # uint16, vocab 50000
    with pytest.raises(ValueError, match="vocab 50000. but the model's vocab_size is 256"):
        TokenBatches(memmap_cfg(path), 256)
    fix = "data.dtype=uint32 but .* says the file is uint16; set data.dtype=uint16"
    with pytest.raises(ValueError, match=fix):
        TokenBatches(memmap_cfg(path, dtype="uint32"), 50_000)
    meta = json.loads(sidecar_path(path).read_text())
    sidecar_path(path).write_text(json.dumps({**meta, "num_tokens": 80}))
    with pytest.raises(ValueError, match="says 80 tokens but .* holds 64; .* re-run it"):
        TokenBatches(memmap_cfg(path), 50_000)


def test_resume_with_other_data_settings_fails():
    state = TokenBatches(DataConfig(seq_len=16), 256).state_dict()
    with pytest.raises(ValueError, match="seq_len=16 but data.seq_len is now 32"):
        TokenBatches(DataConfig(seq_len=32), 256).load_state_dict(state)


def test_resume_on_another_token_file_of_the_same_length_fails(tmp_path):
    cfg, vocab = counting_file(tmp_path, 200)
    state = TokenBatches(cfg, vocab).state_dict()
    write_token_file(Path(cfg.path), (np.arange(200) + 1) % 200, vocab_size=200, tokenizer="counting", eos_id=0)
    with pytest.raises(ValueError, match=r"data.path=.* holds other tokens than the checkpoint was trained on"):
        TokenBatches(cfg, vocab).load_state_dict(state)
    del state["fingerprint"]  # a checkpoint from before the fingerprint: resumed as before
    TokenBatches(cfg, vocab).load_state_dict(state)


# ---- scripts/prepare_data.py ------------------------------------------------------------------


def test_prepare_data_bytes_end_to_end(tmp_path, capsys):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("héllo wörld\n" * 4)
    b.write_text("second document")
    out = tmp_path / "data" / "tokens.bin"
    prepare_data.main(["--out", str(out), str(a), str(b)])
    summary = capsys.readouterr().out
    assert summary.count("\n") == 1 and "tokens (uint16, vocab 256, tokenizer bytes" in summary

    expected = a.read_bytes() + b"\0" + b.read_bytes() + b"\0"
    assert np.fromfile(out, dtype=np.uint16).tolist() == list(expected)
    meta = json.loads(sidecar_path(out).read_text())
    assert meta == {"dtype": "uint16", "vocab_size": 256, "num_tokens": len(expected),
                    "tokenizer": "bytes", "eos_id": 0}
    assert not list(out.parent.glob("*.tmp"))
    # It trains the tiny model as is.
    cfg = DataConfig(kind="memmap", path=str(out), seq_len=8, micro_batch=2)
    assert next(TokenBatches(cfg, MODEL_PRESETS["tiny"].vocab_size)).shape == (2, 9)


def test_prepare_data_bad_inputs(tmp_path, monkeypatch):
    out = str(tmp_path / "t.bin")
    binary = tmp_path / "b.bin"
    binary.write_bytes(b"ab\0c")
    with pytest.raises(ValueError, match="NUL byte at offset 2"):
        prepare_data.main(["--out", out, str(binary)])
    assert not (tmp_path / "t.bin").exists() and not (tmp_path / "t.bin.tmp").exists()
    with pytest.raises(FileNotFoundError, match="input .*missing.txt does not exist"):
        prepare_data.main(["--out", out, str(tmp_path / "missing.txt")])
    text = tmp_path / "a.txt"
    text.write_text("x")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # as if the package were not installed
    with pytest.raises(ImportError, match="needs the `tokenizers` package: pip install tokenizers"):
        prepare_data.main(["--out", out, "--tokenizer", str(tmp_path / "tok.json"), str(text)])


def test_prepare_data_with_tokenizer_json(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "</s>": 1, "hello": 2, "world": 3}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    text = tmp_path / "a.txt"
    text.write_text("hello world hello other")
    out = tmp_path / "t.bin"
    tok_json = str(tmp_path / "tokenizer.json")
    prepare_data.main(["--out", str(out), "--tokenizer", tok_json, str(text)])
    assert np.fromfile(out, dtype=np.uint16).tolist() == [2, 3, 2, 0, 1]
    assert json.loads(sidecar_path(out).read_text())["eos_id"] == 1
    argv = ["--out", str(out), "--tokenizer", tok_json, "--eos-token", "<eot>", str(text)]
    with pytest.raises(ValueError, match="no end-of-text token named <eot>; name it with"):
        prepare_data.main(argv)
