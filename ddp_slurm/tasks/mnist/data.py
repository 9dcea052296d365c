"""MNIST as uint8 tensors: the bundled sample, or full MNIST read (and downloaded) with torchvision.

The task hands them to the runtime's in-memory path (``ddp_slurm.train.loader.InMemory``): one
``uint8 [N, 28, 28]`` tensor on the device, batches gathered by index and normalised as a batch.

``python -m ddp_slurm.data download --root DIR`` fetches full MNIST on a machine with internet.
"""

from __future__ import annotations

import contextlib
import gzip
import logging
import socket
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from ddp_slurm import errors

log = logging.getLogger(__name__)

MEAN, STD = 0.1307, 0.3081  # MNIST pixel statistics, as in pytorch/examples
TRAIN_SIZES = {"sample": 5000, "mnist": 60000}  # known up front, so a bad batch size fails before any work
_FILES = {
    True: ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    False: ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


class DataError(errors.UsageError):
    """Missing or unreadable data; the message says where and what to do (exit 2, one line: bad input,
    found before the run directory is made)."""


@dataclass
class Split:
    images: torch.Tensor  # uint8 [N, 28, 28]
    labels: torch.Tensor  # int64 [N]

    def __len__(self) -> int:
        return self.labels.shape[0]

    def to(self, device: torch.device) -> Split:
        return Split(self.images.to(device), self.labels.to(device))


def _read_idx_gz(blob: bytes, expect_magic: int) -> torch.Tensor:
    """Parse an IDX file (the bundled sample's format: big-endian header, then uint8 data)."""
    data = gzip.decompress(blob)
    magic = int.from_bytes(data[0:4], "big")
    if magic != expect_magic:
        raise DataError(f"bad IDX magic {magic} (expected {expect_magic})")
    ndim = magic & 0xFF
    shape = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    offset = 4 + 4 * ndim
    return torch.frombuffer(bytearray(data[offset:]), dtype=torch.uint8).reshape(shape)


def load_sample(train: bool) -> Split:
    """The 5,000-image train / 5,000-image test MNIST subset shipped inside the package."""
    folder = resources.files("ddp_slurm") / "assets" / "mnist-sample"
    img_name, lbl_name = _FILES[train]
    images = _read_idx_gz((folder / f"{img_name}.gz").read_bytes(), 2051)
    labels = _read_idx_gz((folder / f"{lbl_name}.gz").read_bytes(), 2049).long()
    return Split(images, labels)


def _mnist_files_present(root: Path) -> bool:
    raw = root / "MNIST" / "raw"
    return all((raw / name).exists() for pair in _FILES.values() for name in pair)


DOWNLOAD_TIMEOUT_S = 20.0  # per connect/read; without it a firewalled node waits minutes per mirror


@contextlib.contextmanager
def _socket_timeout(seconds: float):
    """torchvision's urlopen calls pass no timeout; the process-wide default is the only handle on it."""
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(seconds)
    try:
        yield
    finally:
        socket.setdefaulttimeout(previous)


def one_line(exc: BaseException) -> str:
    """An exception as one line: torchvision's download errors span several (one per mirror)."""
    text = " ".join(str(exc).split())
    return text if len(text) <= 300 else text[:297] + "..."


def download(root: Path, timeout_s: float = DOWNLOAD_TIMEOUT_S) -> None:
    """Fetch full MNIST into ``root/MNIST/raw`` with torchvision (checksummed, mirrors tried in turn)."""
    from torchvision.datasets import MNIST

    with _socket_timeout(timeout_s):
        for train in (True, False):
            MNIST(str(root), train=train, download=True)


def load_mnist(root: Path, train: bool) -> Split:
    """Full MNIST through torchvision's own reader. Never downloads: see ``ensure_mnist``."""
    if not _mnist_files_present(root):
        raise DataError(
            f"full MNIST not found under {root}/MNIST/raw: run "
            f"`python -m ddp_slurm.data download --root {root}` on a machine with internet"
        )
    from torchvision.datasets import MNIST

    ds = MNIST(str(root), train=train, download=False)
    return Split(ds.data.to(torch.uint8), ds.targets.long())


def ensure_mnist(root: Path, allow_download: bool, is_main: bool) -> None:
    """Rank 0 downloads missing files (the caller makes the other ranks wait at a barrier)."""
    if _mnist_files_present(root) or not is_main:
        return
    if not allow_download:
        raise DataError(
            f"full MNIST not found under {root}/MNIST/raw and data.download is false: run "
            f"`python -m ddp_slurm.data download --root {root}` on a login node"
        )
    log.info("downloading MNIST to %s", root)
    new = [d for d in (root, root / "MNIST", root / "MNIST" / "raw") if not d.exists()]
    try:
        download(root)
    except Exception as exc:  # torchvision raises RuntimeError/URLError/OSError depending on the failure
        for folder in reversed(new):  # a failed download leaves nothing behind (empty folders it made)
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise DataError(
            f"could not download MNIST to {root} ({one_line(exc)}): run "
            f"`python -m ddp_slurm.data download --root {root}` on a machine with internet"
        ) from None


def load_split(source: str, root: str | Path, train: bool) -> Split:
    if source == "sample":
        return load_sample(train)
    return load_mnist(Path(root), train)


def normalize(images_u8: torch.Tensor) -> torch.Tensor:
    """uint8 [B, 28, 28] -> float32 [B, 1, 28, 28], standardised."""
    return images_u8.unsqueeze(1).float().sub_(MEAN * 255).mul_(1.0 / (STD * 255))
