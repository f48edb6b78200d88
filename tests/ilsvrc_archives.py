"""Tiny archives with the structure of the official ILSVRC2012 ones, made from real pictures (crops of
scikit-learn's two sample photographs and its digit scans, scaled up), for the tests of
`aiperf data prepare`:

- ILSVRC2012_img_train.tar: an outer tar of inner `<wnid>.tar`, each holding `<wnid>_<n>.JPEG`;
- ILSVRC2012_img_val.tar: flat `ILSVRC2012_val_000000NN.JPEG`, stored in an order that is not
  their names' order;
- ILSVRC2012_devkit_t12.tar.gz: `ILSVRC2012_devkit_t12/data/meta.mat` (written by scipy in the
  devkit's struct layout: leaf synsets whose ILSVRC2012_IDs are not in WNID order, and non-leaf
  synsets with children) and `.../data/ILSVRC2012_validation_ground_truth.txt`.

Among the images: a CMYK JPEG, a grayscale JPEG and a PNG named .JPEG (as in the real training set).
`make_archives` returns the truth the tests check against, computed here from what was written,
not from the devkit: each image's WNID, and the class order (sorted WNIDs).
"""

from __future__ import annotations

import io
import tarfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# Leaf synsets: (WNID, ILSVRC2012_ID, words). The ids are deliberately not in WNID order.
LEAVES = [("n02119789", 1, "kit fox, Vulpes macrotis"), ("n01440765", 3, "tench, Tinca tinca"),
          ("n04592741", 2, "wing"), ("n02085620", 4, "Chihuahua")]
NON_LEAVES = [("n00001740", 5, "entity", [6]), ("n02084071", 6, "dog, domestic dog, Canis familiaris", [4])]
TRAIN_PER_CLASS = {"n02119789": 6, "n01440765": 5, "n04592741": 6, "n02085620": 7}
VAL_PER_CLASS = 3
SPECIAL = {("train", "n01440765", 1): "cmyk", ("train", "n02085620", 2): "grayscale",
           ("train", "n04592741", 0): "png", ("val", None, 4): "cmyk"}


@dataclass
class Truth:
    classes: list[str]                           # sorted WNIDs: class index order
    words: dict[str, str]
    train: dict[str, str]                        # file name -> WNID
    val: dict[str, str]                          # file name -> WNID
    originals: dict[str, bytes]                  # file name -> bytes as stored in the archive
    kinds: dict[str, str]                        # file name -> "jpeg", "cmyk", "grayscale", "png"

    def label(self, name: str) -> int:
        """0-based class index of an image, by its file name."""
        wnid = self.train.get(name) or self.val[name]
        return self.classes.index(wnid)


def _pictures(count: int, seed: int) -> list[np.ndarray]:
    """Real pictures: alternately crops of the sample photographs and digit scans, 48-96 px."""
    from sklearn.datasets import load_digits, load_sample_images

    rng = np.random.default_rng(seed)
    photos = load_sample_images().images
    digits = (load_digits().images * (255.0 / 16.0)).astype(np.uint8)
    out = []
    for i in range(count):
        if i % 2:
            photo = photos[i // 2 % 2]
            h, w = int(rng.integers(48, 80)), int(rng.integers(56, 96))
            top, left = int(rng.integers(0, photo.shape[0] - h)), int(rng.integers(0, photo.shape[1] - w))
            out.append(np.ascontiguousarray(photo[top:top + h, left:left + w]))
        else:
            scan = np.kron(digits[int(rng.integers(0, len(digits)))], np.ones((8, 8), np.uint8))
            out.append(np.stack([scan, 255 - scan, scan // 2], axis=2))  # 64x64, coloured
    return out


def encode(pixels: np.ndarray, kind: str) -> bytes:
    from PIL import Image

    image = Image.fromarray(pixels)
    buf = io.BytesIO()
    if kind == "png":
        image.save(buf, format="PNG")
    elif kind == "cmyk":
        image.convert("CMYK").save(buf, format="JPEG", quality=90)
    elif kind == "grayscale":
        image.convert("L").save(buf, format="JPEG", quality=90)
    else:
        image.save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def _tar_bytes(files: list[tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name, data in files:
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 1_300_000_000
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def meta_mat(leaves=LEAVES, non_leaves=NON_LEAVES, train_counts=None) -> bytes:
    """meta.mat as the devkit has it: a 1-column struct array `synsets`, each field a MATLAB array."""
    from scipy.io import savemat

    train_counts = train_counts or TRAIN_PER_CLASS
    fields = ["ILSVRC2012_ID", "WNID", "words", "gloss", "num_children", "children", "wordnet_height",
              "num_train_images"]
    rows = [(i, w, words, [], 0, train_counts.get(w, 0)) for w, i, words in leaves]
    rows += [(i, w, words, children, 1, 0) for w, i, words, children in non_leaves]
    rows.sort()  # the devkit lists synsets by ILSVRC2012_ID
    synsets = np.zeros((len(rows), 1), dtype=[(f, object) for f in fields])
    for k, (i, w, words, children, height, count) in enumerate(rows):
        synsets[k, 0] = (np.array([[i]], np.uint16), np.array([w]), np.array([words]), np.array([f"gloss of {w}"]),
                         np.array([[len(children)]], np.uint8), np.array([children], np.uint16).reshape(1, -1),
                         np.array([[height]], np.uint8), np.array([[count]], np.uint16))
    buf = io.BytesIO()
    savemat(buf, {"synsets": synsets})
    return buf.getvalue()


def devkit(meta: bytes, truth: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in (("ILSVRC2012_devkit_t12/data/meta.mat", meta),
                           ("ILSVRC2012_devkit_t12/data/ILSVRC2012_validation_ground_truth.txt", truth.encode()),
                           ("ILSVRC2012_devkit_t12/readme.txt", b"devkit\n")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def make_archives(folder, seed: int = 0) -> Truth:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    ids = {w: i for w, i, _ in LEAVES}
    truth = Truth(sorted(ids), {w: words for w, _, words in LEAVES}, {}, {}, {}, {})
    pictures = iter(_pictures(sum(TRAIN_PER_CLASS.values()) + VAL_PER_CLASS * len(LEAVES), seed))
    inner = []
    for wnid, _, _ in LEAVES:  # the outer tar in the devkit's order, not sorted
        files = []
        for n in range(TRAIN_PER_CLASS[wnid]):
            kind = SPECIAL.get(("train", wnid, n), "jpeg")
            name = f"{wnid}_{1000 + 7 * n}.JPEG"
            data = encode(next(pictures), kind)
            files.append((name, data))
            truth.train[name], truth.originals[name], truth.kinds[name] = wnid, data, kind
        inner.append((f"{wnid}.tar", _tar_bytes(files[::-1])))  # stored out of name order too
    (folder / "ILSVRC2012_img_train.tar").write_bytes(_tar_bytes(inner))

    rng = np.random.default_rng(seed)
    val_wnids = [w for w, _, _ in LEAVES for _ in range(VAL_PER_CLASS)]
    rng.shuffle(val_wnids)
    lines, files = [], []
    for number, wnid in enumerate(val_wnids, start=1):
        kind = SPECIAL.get(("val", None, number), "jpeg")
        name = f"ILSVRC2012_val_{number:08d}.JPEG"
        data = encode(next(pictures), kind)
        files.append((name, data))
        lines.append(str(ids[wnid]))
        truth.val[name], truth.originals[name], truth.kinds[name] = wnid, data, kind
    order = rng.permutation(len(files))
    (folder / "ILSVRC2012_img_val.tar").write_bytes(_tar_bytes([files[i] for i in order]))
    (folder / "ILSVRC2012_devkit_t12.tar.gz").write_bytes(devkit(meta_mat(), "\n".join(lines) + "\n"))
    return truth


def overwrite_in_place(archive: Path, member: bytes, start: int, stop: int) -> None:
    """Damage `archive` without changing its size (a resumed prepare still takes it for the same
    archive): bytes [start, stop) around the stored bytes of `member` (its tar header is
    [-512, 0)) become 0xFF."""
    data = bytearray(Path(archive).read_bytes())
    at = data.index(member)
    data[at + start:at + stop] = b"\xff" * (stop - start)
    Path(archive).write_bytes(bytes(data))
