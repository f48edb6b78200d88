"""JPEG decoding on the GPU for the torch backend: torchvision's nvJPEG binding.

Used for streamed ImageFolder and TFRecord data when the training device is CUDA, torchvision is
installed (the CUDA images ship it; `import torchvision` is lazy) and the run did not ask for DALI
(policy item data_loader). Split of the work:

* DataLoader workers (host): read each image's stored bytes, parse its JPEG header for the size
  (Pillow reads the header only), and draw its augmentation exactly as
  aiperf_core.data.preprocess does: the random-resized-crop box from
  `random_crop_box(width, height, augmentation_rng(seed, epoch, index))`, then the flip from the
  same generator. An image that cannot be read is skipped and counted, as in the host pipeline. An
  image that is not a JPEG (a PNG in an ImageFolder) is decoded on the host by the source itself.
* the GPU: `torchvision.io.decode_jpeg(list, device=...)` decodes the whole batch; each image is
  cropped to its box, resized to size x size (bilinear with antialiasing, as Pillow's BILINEAR
  resize with a box), rounded to uint8 and flipped; the batch is uint8 NHWC on the device, like
  every other feed's. If nvJPEG rejects a batch, its images are decoded one by one to find the
  ones it rejects, which are skipped and counted.

Where the pixels differ from the host pipeline (the distributions are the same):
* Pillow decodes a JPEG at a reduced DCT scale (draft mode) when the crop allows; nvJPEG decodes at
  full resolution and the resize then averages more source pixels.
* validation: Pillow resizes with a fractional box (the central crop of the resized image, mapped
  back); here the box is rounded to whole source pixels (at most half a source pixel of shift).
* nvJPEG's IDCT and colour conversion are not libjpeg-turbo's (a level or two per pixel).

Unverified on a GPU in this repository's CI: the CPU tests run this code with a Pillow decoder in
place of nvJPEG (`decode` argument) and check the boxes, flips, crops and resizes against
preprocess.py; docs/backends/torch.md lists what a GPU session should check.
"""

from __future__ import annotations

import io
from functools import lru_cache
from typing import Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F

from aiperf_backends.torch.feeds import DeviceBatch, Feed, stream_loader

# One image as the workers plan it: encoded JPEG bytes (uint8 tensor) and its box and flip, or
# host-decoded pixels (a format nvJPEG does not take).
JPEG, HOST = 0, 1


@lru_cache(maxsize=1)
def available() -> bool:
    """Whether torchvision's GPU JPEG decoder is importable (CUDA is the caller's check)."""
    try:
        import torchvision.io  # noqa: F401
    except Exception:  # not installed, or a build that does not match torch
        return False
    return hasattr(torchvision.io, "decode_jpeg")


def val_box(width: int, height: int, size: int) -> tuple[int, int, int, int]:
    """(left, top, width, height), in source pixels rounded to whole ones, of the region that
    preprocess.val_image maps to its size x size output: shorter side resized to size / 0.875,
    central crop."""
    from aiperf_core.data.preprocess import VAL_CROP_FRACTION

    short = max(int(round(size / VAL_CROP_FRACTION)), size)
    factor = short / min(width, height)
    new_w, new_h = max(size, int(round(width * factor))), max(size, int(round(height * factor)))
    sx, sy = width / new_w, height / new_h  # source pixels per resized pixel
    left, top = (new_w - size) / 2 * sx, (new_h - size) / 2 * sy
    w, h = max(1, int(round(size * sx))), max(1, int(round(size * sy)))
    return min(int(round(left)), width - w), min(int(round(top)), height - h), w, h


def plan_image(source, split: str, index: int, size: int, seed: int, epoch: int):
    """What a worker sends for one image: (JPEG, encoded tensor, (left, top, w, h), flip) or
    (HOST, pixels tensor, None, False); raises CorruptImage when it cannot be read."""
    from PIL import Image

    from aiperf_core.data.preprocess import CorruptImage, augmentation_rng, random_crop_box
    from aiperf_core.data.stream import TRAIN

    where = source.where(split, index)
    encoded = source.encoded(split, index)
    try:
        header = Image.open(io.BytesIO(encoded))
        fmt, (width, height) = header.format, header.size
    except Exception as exc:  # Pillow raises several types for unreadable data
        raise CorruptImage(f"{where}: not a readable image ({type(exc).__name__})") from None
    if fmt != "JPEG" or header.mode not in ("RGB", "L", "CMYK", "YCbCr"):
        pixels = source.example(split, index, size, seed, epoch)
        return HOST, torch.from_numpy(np.ascontiguousarray(pixels)), None, False
    if split == TRAIN:
        rng = augmentation_rng(seed, epoch, index)
        box = random_crop_box(width, height, rng)
        flip = bool(rng.random() < 0.5)
    else:
        box, flip = val_box(width, height, size), False
    return JPEG, torch.frombuffer(bytearray(encoded), dtype=torch.uint8), box, flip


class EncodedShards(torch.utils.data.Dataset):
    """Item (epoch, k): this rank's shard of global batch k, planned for GPU decoding:
    (kinds, payloads, boxes, flips, labels, skipped, global batch size)."""

    def __init__(self, data, split: str, seed: int, batch_size: int, rank: int, world: int):
        self.data, self.split, self.seed, self.batch_size = data, split, seed, batch_size
        self.rank, self.world = rank, world
        self._plan: tuple[int, list] | None = None

    def __len__(self) -> int:
        return -(-self.data.source.count(self.split) // self.batch_size)

    def __getitem__(self, key):
        from aiperf_core.data.preprocess import CorruptImage
        from aiperf_core.data.stream import shard

        epoch, k = key
        if self._plan is None or self._plan[0] != epoch:
            self._plan = (epoch, self.data.plan(self.split, epoch, self.seed, self.batch_size))
        indices = self._plan[1][k]
        labels = self.data.source.labels(self.split)
        kinds, payloads, boxes, flips, kept = [], [], [], [], []
        skipped = 0
        for index in shard(indices, self.rank, self.world):
            try:
                kind, payload, box, flip = plan_image(self.data.source, self.split, int(index), self.data.image_size,
                                                      self.seed, epoch)
            except CorruptImage:
                skipped += 1
                continue
            kinds.append(kind)
            payloads.append(payload)
            boxes.append(box or (0, 0, 0, 0))
            flips.append(flip)
            kept.append(labels[index])
        return (torch.tensor(kinds, dtype=torch.int8), payloads, torch.tensor(boxes, dtype=torch.int64).reshape(-1, 4),
                torch.tensor(flips, dtype=torch.bool), torch.tensor(np.asarray(kept, np.int64)), skipped, len(indices))


def crop_resize(image: torch.Tensor, box, size: int, flip: bool) -> torch.Tensor:
    """A decoded CHW uint8 image -> its box resized to size x size (bilinear, antialiased, as
    Pillow's BILINEAR), rounded to uint8, flipped if asked: HWC uint8."""
    left, top, w, h = (int(v) for v in box)
    region = image[:, top:top + h, left:left + w].unsqueeze(0).float()
    out = F.interpolate(region, size=(size, size), mode="bilinear", align_corners=False, antialias=True)
    out = out[0].round_().clamp_(0, 255).to(torch.uint8)
    if flip:
        out = out.flip(-1)
    return out.permute(1, 2, 0)


def gpu_decode(encoded: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """torchvision's batched nvJPEG decode to RGB CHW uint8 tensors on `device`."""
    import torchvision.io as tvio

    return tvio.decode_jpeg(encoded, mode=tvio.ImageReadMode.RGB, device=device)


def decode_batch(item, size: int, device: torch.device,
                 decode: Callable[[list[torch.Tensor], torch.device], list[torch.Tensor]] = gpu_decode):
    """(uint8 NHWC pixels on `device`, labels on `device`, images skipped) of one planned shard."""
    kinds, payloads, boxes, flips, labels, skipped, _ = item
    jpegs = [i for i, kind in enumerate(kinds.tolist()) if kind == JPEG]
    decoded: dict[int, torch.Tensor] = {}
    if jpegs:
        try:
            images = decode([payloads[i] for i in jpegs], device)
            decoded = dict(zip(jpegs, images))
        except RuntimeError:  # nvJPEG fails the whole batch: find the images it rejects
            for i in jpegs:
                try:
                    decoded[i] = decode([payloads[i]], device)[0]
                except RuntimeError:
                    pass
    keep, out = [], []
    for i, kind in enumerate(kinds.tolist()):
        if kind == HOST:
            out.append(payloads[i].to(device, non_blocking=True))
        elif i in decoded:
            out.append(crop_resize(decoded[i], boxes[i].tolist(), size, bool(flips[i])))
        else:
            continue
        keep.append(i)
    skipped += len(kinds) - len(keep)
    if out:
        x = torch.stack(out)
    else:
        x = torch.empty((0, size, size, 3), dtype=torch.uint8, device=device)
    y = labels[torch.tensor(keep, dtype=torch.int64)] if keep else labels[:0]
    return x, y.to(device, non_blocking=True), skipped


class NvjpegFeed(Feed):
    """Streamed JPEGs decoded on the GPU: the DataLoader's workers read and plan each shard (the
    encoded bytes ahead, pinned), the GPU decodes, crops, resizes and flips it."""

    may_skip = True

    def __init__(self, data, split: str, seed: int, batch_size: int, device: torch.device, rank: int, world: int,
                 decode=gpu_decode):
        self.data, self.device, self.decode = data, device, decode
        items = EncodedShards(data, split, seed, batch_size, rank, world)
        self.loader = stream_loader(data, split, seed, batch_size, device, rank, world, items=items)

    def epoch(self, epoch: int) -> Iterator[DeviceBatch]:
        self.loader.sampler.set_epoch(epoch)
        for item in self.loader:
            x, y, skipped = decode_batch(item, self.data.image_size, self.device, decode=self.decode)
            yield DeviceBatch(x, y, int(item[-1]), int(skipped))

    def close(self) -> None:
        self.loader = None

