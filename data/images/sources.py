"""Labelled image collections read by index: ImageFolder trees, WebDataset-style tar shards, HF `datasets`.

Every source answers `len()`, `load(index) -> (RGB PIL image, label)`, `where(index)` (a file or shard
member, for error messages) and its class count. Random access is what the resumable sampler needs:
a sample's position in an epoch decides what is read, not a stream's progress. Tar shards are therefore
indexed once (member offsets and labels) and read with seeks, not streamed.
"""

from __future__ import annotations

import glob
import io
import os
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

from core.errors import UserError

# torchvision's ImageFolder extensions (lower case).
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
# WebDataset member suffixes: the image and the integer class label of one sample.
TAR_IMAGE_SUFFIXES = ("jpg", "jpeg", "png", "webp")
TAR_LABEL_SUFFIX = "cls"


class ImageReadError(UserError, ValueError):
    """An image that cannot be decoded; the message names the file (or shard and member)."""


def decode_image(data: bytes | str | Path | Image.Image, where: str) -> Image.Image:
    """An RGB image from encoded bytes or a path; errors name `where` instead of a bare PIL message."""
    try:
        if isinstance(data, Image.Image):
            image = data
        else:
            image = Image.open(io.BytesIO(data) if isinstance(data, bytes) else data)
        return image.convert("RGB")  # convert() forces the decode, so truncated files fail here
    except (OSError, UnidentifiedImageError, ValueError, SyntaxError) as err:
        raise ImageReadError(f"cannot read image {where}: {err}") from err


class FolderSource:
    """`root/<class>/**/<image>` as torchvision's ImageFolder: classes are the sorted folder names."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise FileNotFoundError(f"image folder {self.root} does not exist")
        self.classes = sorted(entry.name for entry in os.scandir(self.root) if entry.is_dir())
        if not self.classes:
            raise ValueError(f"image folder {self.root} has no class folders (expected {self.root}/<class>/<image>)")
        self.samples: list[tuple[str, int]] = []
        empty = []
        for label, name in enumerate(self.classes):
            found = sorted(
                os.path.join(directory, file)
                for directory, _, files in os.walk(self.root / name, followlinks=True)
                for file in files
                if file.lower().endswith(IMAGE_EXTENSIONS)
            )
            empty += [] if found else [name]
            self.samples += [(path, label) for path in found]
        if empty:
            raise ValueError(
                f"image folder {self.root}: class folder(s) {', '.join(empty[:5])} hold no images "
                f"({', '.join(IMAGE_EXTENSIONS)})"
            )
        self.num_classes = len(self.classes)
        self.max_label = self.num_classes - 1

    def __len__(self) -> int:
        return len(self.samples)

    def where(self, index: int) -> str:
        return self.samples[index][0]

    def load(self, index: int) -> tuple[Image.Image, int]:
        path, label = self.samples[index]
        return decode_image(path, path), label


def tar_shards(path: str | Path, split: str) -> list[Path]:
    """The shards of `split`: `path/split/*.tar`, else `path/split-*.tar`, or a glob `path/<split pattern>`."""
    root = Path(path)
    if glob.has_magic(split):
        patterns = [str(root / split)]
    elif (root / split).is_dir():
        patterns = [str(root / split / "*.tar")]
    else:
        patterns = [str(root / f"{split}-*.tar"), str(root / f"{split}_*.tar")]
    for pattern in patterns:
        found = sorted(Path(p) for p in glob.glob(pattern))
        if found:
            return found
    raise FileNotFoundError(f"no tar shards for split '{split}' under {root} (looked for {' or '.join(patterns)})")


class TarShardSource:
    """WebDataset-style shards: members `<key>.<jpg|jpeg|png|webp>` and `<key>.cls` (the integer label).

    Opening scans every member header once (the label files are read, the images only located), so each
    sample can later be read with one seek. The index is four numpy arrays, cheap to send to workers.
    """

    def __init__(self, shards: list[Path]) -> None:
        if not shards:
            raise ValueError("no tar shards given")
        self.shards = [str(s) for s in shards]
        shard_ids, offsets, sizes, labels, self._keys = [], [], [], [], []
        self.shard_sizes = []
        for shard_id, shard in enumerate(self.shards):
            members = self._scan(shard)
            for key, (image, label) in members.items():
                shard_ids.append(shard_id)
                offsets.append(image.offset_data)
                sizes.append(image.size)
                labels.append(label)
                self._keys.append(key)
            self.shard_sizes.append(len(members))
        if not labels:
            raise ValueError(f"tar shards {self.shards[0]} ... ({len(self.shards)} files) hold no samples")
        self.shard_ids = np.asarray(shard_ids, dtype=np.int32)
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.sizes = np.asarray(sizes, dtype=np.int64)
        self.labels = np.asarray(labels, dtype=np.int64)
        self.num_classes = None  # labels are bare integers: only their range can be checked
        self.max_label = int(self.labels.max())
        if int(self.labels.min()) < 0:
            raise ValueError(f"tar shards {self.shards[0]} ...: negative class label {int(self.labels.min())}")

    @staticmethod
    def _scan(shard: str) -> dict[str, tuple[tarfile.TarInfo, int]]:
        images: dict[str, tarfile.TarInfo] = {}
        labels: dict[str, int] = {}
        try:
            with tarfile.open(shard, mode="r:") as archive:
                for member in archive:
                    if not member.isfile():
                        continue
                    directory, _, base = member.name.rpartition("/")
                    stem, _, suffix = base.partition(".")  # WebDataset: the key ends at the first dot
                    key = f"{directory}/{stem}" if directory else stem
                    if suffix.lower() in TAR_IMAGE_SUFFIXES:
                        images[key] = member
                    elif suffix == TAR_LABEL_SUFFIX:
                        text = archive.extractfile(member).read().decode().strip()
                        try:
                            labels[key] = int(text)
                        except ValueError:
                            raise ValueError(
                                f"{shard}: {member.name} holds '{text[:40]}', not an integer label"
                            ) from None
        except tarfile.TarError as err:
            raise ImageReadError(f"cannot read tar shard {shard}: {err}") from err
        unlabelled = sorted(set(images) - set(labels))
        if unlabelled:
            raise ValueError(f"{shard}: image {unlabelled[0]} has no {unlabelled[0]}.{TAR_LABEL_SUFFIX} label member")
        return {key: (images[key], labels[key]) for key in images}

    def __len__(self) -> int:
        return len(self.labels)

    def where(self, index: int) -> str:
        return f"{self.shards[self.shard_ids[index]]}:{self._keys[index]}"

    def load(self, index: int) -> tuple[Image.Image, int]:
        with open(self.shards[self.shard_ids[index]], "rb") as handle:
            handle.seek(int(self.offsets[index]))
            data = handle.read(int(self.sizes[index]))
        return decode_image(data, self.where(index)), int(self.labels[index])


class HFImageSource:
    """A Hugging Face `datasets` split with an image column and an integer (or ClassLabel) label column.

    `path` is a `save_to_disk` directory (a DatasetDict holding `split`, or one Dataset), else a dataset
    name for `load_dataset` (needs network or a populated cache).
    """

    def __init__(self, path: str, split: str, image_key: str = "image", label_key: str = "label") -> None:
        import datasets

        self.path, self.split, self.image_key, self.label_key = str(path), split, image_key, label_key
        if Path(path).is_dir():
            loaded = datasets.load_from_disk(str(path))
            if isinstance(loaded, datasets.DatasetDict):
                if split not in loaded:
                    raise ValueError(f"HF dataset {path} has splits {', '.join(loaded)}, not '{split}'")
                loaded = loaded[split]
        else:
            loaded = datasets.load_dataset(str(path), split=split)
        for key in (image_key, label_key):
            if key not in loaded.column_names:
                raise ValueError(f"HF dataset {path} ({split}) has columns {loaded.column_names}, no '{key}'")
        if len(loaded) == 0:
            raise ValueError(f"HF dataset {path} split '{split}' is empty")
        self.dataset = loaded
        feature = loaded.features[label_key]
        is_class_label = isinstance(feature, datasets.ClassLabel)
        self.num_classes = feature.num_classes if is_class_label else None
        self.classes = list(feature.names) if is_class_label else None  # the label names, in label order
        labels = np.asarray(loaded[label_key])
        self.max_label = int(labels.max())

    def __len__(self) -> int:
        return len(self.dataset)

    def where(self, index: int) -> str:
        return f"{self.path} ({self.split}) row {index}"

    def load(self, index: int) -> tuple[Image.Image, int]:
        try:
            row = self.dataset[index]
        except (OSError, UnidentifiedImageError, ValueError, SyntaxError) as err:  # the Image feature decodes here
            raise ImageReadError(f"cannot read image {self.where(index)}: {err}") from err
        image = row[self.image_key]
        if isinstance(image, dict):  # an Image feature stored with decode=False: {"bytes": ..., "path": ...}
            image = image.get("bytes") or image.get("path")
        return decode_image(image, self.where(index)), int(row[self.label_key])


def open_source(
    format: str, path: str | Path, split: str, **hf_keys: Any
) -> FolderSource | TarShardSource | HFImageSource:
    """The source of `split` under `path` in `format` (folder | tar | hf)."""
    if format == "folder":
        return FolderSource(Path(path) / split)
    if format == "tar":
        return TarShardSource(tar_shards(path, split))
    if format == "hf":
        return HFImageSource(str(path), split, **hf_keys)
    raise ValueError(f"data.format={format} must be one of folder, tar, hf")
