"""The checkpoint seal (format 4): an XXH3-128 tree over every byte, computed while written, as a trailer.

Checked against an independent reading of the file (xxhash over the bytes before the trailer), with
states big enough to span several slices and the write-behind, and against each way a sealed file can
go wrong: a flipped bit anywhere, a cut-off tail, a file rewritten without its seal. Files of the
earlier formats (SHA-256 seal; the digest inside the pickle) still load, and still catch a flipped bit.
"""

from __future__ import annotations

import hashlib
import io
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash

from ddp_slurm.train import checkpoint
from ddp_slurm.train.checkpoint import seal as ckpt_seal


def big_state(step: int, mib: int) -> dict[str, Any]:
    """``mib`` MiB of float32 in 4 MiB tensors, a small one, plain values."""
    g = torch.Generator().manual_seed(step)
    layers = {f"layer{i}": torch.rand(1 << 20, generator=g) for i in range(mib // 4)}
    return {
        "model": {"bias": torch.rand(7, generator=g), **layers},
        "step": step,
        "epoch": 1,
        "finished": False,
        "history": [0.5, 0.25],
    }


TRAILER_BYTES = 33 + 32 + 1  # "\nddp_slurm-xxh3-128-16MiB-slices ", 32 hex digits, a newline


def split(path: Path, trailer_bytes: int = TRAILER_BYTES) -> tuple[bytes, bytes]:
    data = path.read_bytes()
    return data[:-trailer_bytes], data[-trailer_bytes:]


def expected_trailer(body: bytes) -> bytes:
    """The documented seal, computed here on its own: XXH3-128 of the XXH3-128s of 16 MiB slices."""
    slices = [xxhash.xxh3_128(body[i : i + (16 << 20)]).digest() for i in range(0, len(body), 16 << 20)]
    return b"\nddp_slurm-xxh3-128-16MiB-slices " + xxhash.xxh3_128(b"".join(slices)).hexdigest().encode() + b"\n"


def format_3_file(path: Path, state: dict[str, Any], fmt: int = 3) -> None:
    """A checkpoint as the previous release wrote it: torch.save, then a SHA-256 tree of 16 MiB slices."""
    buf = io.BytesIO()
    torch.save(dict(state, format=fmt), buf)
    body = buf.getvalue()
    slices = [hashlib.sha256(body[i : i + (16 << 20)]).digest() for i in range(0, len(body), 16 << 20)]
    seal = hashlib.sha256(b"".join(slices)).hexdigest().encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(body + b"\nddp_slurm-sha256-16MiB-slices " + seal + b"\n")


def test_the_trailer_length_is_the_schemes() -> None:
    assert ckpt_seal.XXH3.trailer_bytes == TRAILER_BYTES and ckpt_seal.SHA256.trailer_bytes == 31 + 64 + 1


@pytest.mark.parametrize("mib", [0, 8, 40])  # 40 MiB: more than two slices
def test_the_seal_covers_every_byte_before_it(tmp_path: Path, mib: int) -> None:
    assert 40 << 20 > 2 * ckpt_seal.SLICE
    state = big_state(3, mib)
    path = checkpoint.save(tmp_path, state, keep=2)
    body, tail = split(path)
    assert tail == expected_trailer(body)
    # A sealed file is still a plain torch.save file for any reader (the trailer follows the zip archive).
    for mmap in (False, True):
        plain = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
        assert plain["step"] == 3 and plain["format"] == checkpoint.FORMAT
        assert all(torch.equal(plain["model"][k], v) for k, v in state["model"].items())
    loaded = checkpoint.load(path)
    assert loaded["history"] == [0.5, 0.25] and torch.equal(loaded["model"]["bias"], state["model"]["bias"])
    with open(path, "rb") as f:
        assert ckpt_seal.check(f) is ckpt_seal.XXH3


def test_pieces_of_any_size_across_slice_boundaries(tmp_path: Path) -> None:
    """What torch.save hands over: small headers, records of any size, some far bigger than a slice."""
    g = torch.Generator().manual_seed(0)
    sizes = [30, 1, (3 << 20) + 7, 0, 64, (16 << 20) - 9, 9, (37 << 20) + 1, 5, 1 << 20, (16 << 20) * 2]
    pieces = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).numpy().tobytes() for n in sizes]
    target = tmp_path / "pieces.bin"
    with open(target, "wb") as f:
        sink = ckpt_seal.Sink(f)
        for piece in pieces:
            assert sink.write(memoryview(piece)) == len(piece)
        sink.seal()
    body, tail = split(target)
    assert body == b"".join(pieces) and tail == expected_trailer(body)
    with open(target, "rb") as f:
        assert ckpt_seal.check(f) is ckpt_seal.XXH3


@pytest.mark.parametrize("where", ["zip header", "pickle", "tensor data", "zip directory", "the seal itself"])
def test_a_flipped_bit_anywhere_fails_the_seal(tmp_path: Path, where: str) -> None:
    path = checkpoint.save(tmp_path, big_state(5, 8), keep=2)
    data = bytearray(path.read_bytes())
    body_len = len(data) - TRAILER_BYTES
    at = {
        "zip header": 10,
        "pickle": data.index(b"history"),
        "tensor data": body_len // 2,
        "zip directory": data.rindex(b"PK\x01\x02") + 20,
        "the seal itself": body_len + len(ckpt_seal.XXH3.magic) + 5,
    }[where]
    data[at] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="digest mismatch"):
        checkpoint.load(path)


@pytest.mark.parametrize(
    "how",
    ["cut inside the seal", "seal removed", "rewritten by torch.save"],
)
def test_a_format_4_file_without_its_seal_is_refused(tmp_path: Path, how: str) -> None:
    path = checkpoint.save(tmp_path, big_state(7, 4), keep=2)
    body, tail = split(path)
    if how == "cut inside the seal":
        path.write_bytes(body + tail[:-1])
    elif how == "seal removed":
        path.write_bytes(body)
    else:  # e.g. a script that loaded it, changed a value and saved it again
        state = torch.load(path, map_location="cpu", weights_only=True)
        torch.save(dict(state, epoch=2), path)
    with open(path, "rb") as f:
        assert ckpt_seal.check(f) is None
    with pytest.raises(ValueError, match="no digest at the end of the file"):
        checkpoint.load(path)


def format_2_file(path: Path, state: dict[str, Any]) -> None:
    """A checkpoint as the previous release wrote it: the digest inside the pickle, no seal."""
    old = dict(state, format=2)
    old["content_sha256"] = checkpoint.content_digest(old)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(old, path)


def test_format_2_files_still_load_and_still_catch_a_flipped_value(tmp_path: Path) -> None:
    state = big_state(9, 4)
    path = checkpoint.checkpoint_dir(tmp_path) / checkpoint.file_name(9)
    format_2_file(path, state)
    loaded = checkpoint.load(path)
    assert loaded["format"] == 2 and torch.equal(loaded["model"]["layer0"], state["model"]["layer0"])
    assert checkpoint.latest(tmp_path)[1]["step"] == 9
    # Saved again (as a resumed run does), it becomes format 4, its old digest field dropped.
    again = checkpoint.save(tmp_path, dict(loaded, step=10), keep=2)
    assert "content_sha256" not in checkpoint.load(again) and checkpoint.load(again)["format"] == 4
    format_2_file(path, dict(state, epoch=4))
    data = torch.load(path, map_location="cpu", weights_only=True)
    buf = io.BytesIO()
    torch.save(dict(data, epoch=5), buf)  # a changed value under the old digest
    path.write_bytes(buf.getvalue())
    with pytest.raises(ValueError, match="content digest mismatch"):
        checkpoint.load(path)


@pytest.mark.parametrize("mib", [4, 40])
def test_format_3_files_still_load_and_still_catch_a_flipped_bit(tmp_path: Path, mib: int) -> None:
    """SHA-256 sealed files of the previous release: still resumed from, still checked byte for byte."""
    state = big_state(11, mib)
    path = checkpoint.checkpoint_dir(tmp_path) / checkpoint.file_name(11)
    format_3_file(path, state)
    with open(path, "rb") as f:
        assert ckpt_seal.check(f) is ckpt_seal.SHA256
    loaded = checkpoint.load(path)
    assert loaded["format"] == 3 and torch.equal(loaded["model"]["layer0"], state["model"]["layer0"])
    assert checkpoint.latest(tmp_path)[1]["step"] == 11
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="digest mismatch"):
        checkpoint.load(path)


def test_a_seal_of_the_other_scheme_does_not_pass_for_its_format(tmp_path: Path) -> None:
    """A format-4 state under a (valid) SHA-256 trailer: the format names the seal it needs."""
    path = tmp_path / "mixed.pt"
    format_3_file(path, big_state(2, 0), fmt=4)
    with open(path, "rb") as f:
        assert ckpt_seal.check(f) is ckpt_seal.SHA256
    with pytest.raises(ValueError, match="no digest at the end of the file"):
        checkpoint.load(path)


def test_a_cancel_stops_the_sink_before_the_next_piece(tmp_path: Path) -> None:
    cancel = threading.Event()
    target = tmp_path / "out.bin"
    with open(target, "wb") as f:
        sink = ckpt_seal.Sink(f, cancel)
        sink.write(b"x" * (2 << 20))
        cancel.set()
        with pytest.raises(ckpt_seal.Cancelled):
            sink.write(b"y" * 10)
    assert target.stat().st_size == 2 << 20


def test_the_sink_keeps_the_first_os_error(tmp_path: Path) -> None:
    """A full disk (ENOSPC) as torch's zip writer would see it: the reason is kept for the one-line error."""
    with open("/dev/full", "wb", buffering=0) as f:
        sink = ckpt_seal.Sink(f)
        with pytest.raises(OSError):
            sink.write(b"z" * (2 << 20))
        with pytest.raises(OSError):
            sink.seal()
        assert sink.error is not None and "No space left" in sink.error.strerror
