"""Image calibration / verification data: a folder of JPEG/PNG files (searched recursively, in sorted order),
decoded, converted to the model's channel mode, resized and normalised into a float32 ``(N, C, H, W)`` batch.

Settings come from the options, else the model folder's ``preprocessor_config.json``, else ImageNet's
(224x224, mean 0.485/0.456/0.406, std 0.229/0.224/0.225; for a 1-channel model their luma, mean 0.459, std
0.2256); the summary says which. Every image is converted to one mode (RGB for 3-channel models, L for
1-channel), as torchvision's ImageFolder does; the summary counts conversions. 16-bit and float images are
refused (converting them to 8 bits would clip, not scale).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from quantcli.errors import DataError, MissingExtraError, first_line

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
IMAGENET_SIZE = (224, 224)
# a 1-channel (L) model: ImageNet's statistics of the luma PIL computes, 0.299 R + 0.587 G + 0.114 B
LUMA = (0.299, 0.587, 0.114)
IMAGENET_MEAN_L = (round(sum(w * m for w, m in zip(LUMA, IMAGENET_MEAN)), 4),)
IMAGENET_STD_L = (round(sum(w * m for w, m in zip(LUMA, IMAGENET_STD)), 4),)
_CONVERTIBLE = {"1", "L", "LA", "P", "PA", "RGB", "RGBA", "RGBX", "CMYK", "YCbCr", "LAB", "HSV"}


#: PIL's resampling filters by the numbers ``preprocessor_config.json`` stores (``resample``)
RESAMPLE_NAMES = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}
BILINEAR = 2


@dataclass
class ImageSettings:
    """How images become tensors, as Hugging Face image processors do it: a resize (to ``resize_to``, or the
    shorter side to ``resize_shorter`` keeping the aspect ratio, or straight to ``size``), then, with
    ``crop``, a center crop to ``size``."""

    size: tuple[int, int]  # (height, width) of the model input, pixels
    mean: tuple[float, ...]
    std: tuple[float, ...]
    resize_shorter: int | None = None
    rescale: float = 1 / 255
    source: str = "ImageNet defaults"
    mode: str = "RGB"  # what every image is converted to
    conversions: dict[str, int] = field(default_factory=dict)
    resize_to: tuple[int, int] | None = None  # (height, width) before the crop
    crop: bool = False  # center crop to ``size`` after the resize (always with ``resize_shorter``)
    resample: int = BILINEAR  # a PIL filter (RESAMPLE_NAMES)
    flip_channels: bool = False  # RGB -> BGR after decoding (``do_flip_channel_order``: MobileViT)

    def __post_init__(self):
        self.crop = self.crop or self.resize_shorter is not None

    def to_plain(self) -> dict[str, Any]:
        return {
            "kind": "image",
            "size": list(self.size),
            "mean": list(self.mean),
            "std": list(self.std),
            "resize_shorter": self.resize_shorter,
            "resize_to": None if self.resize_to is None else list(self.resize_to),
            "crop": self.crop,
            "resample": self.resample,
            "flip_channels": self.flip_channels,
            "rescale": self.rescale,
            "source": self.source,
        }

    @classmethod
    def from_plain(cls, d: dict[str, Any]) -> ImageSettings:
        return cls(
            tuple(d["size"]),
            tuple(d["mean"]),
            tuple(d["std"]),
            d.get("resize_shorter"),
            d.get("rescale", 1 / 255),
            d.get("source", "stored in the checkpoint"),
            resize_to=tuple(d["resize_to"]) if d.get("resize_to") else None,
            crop=bool(d.get("crop", False)),
            resample=int(d.get("resample", BILINEAR)),
            flip_channels=bool(d.get("flip_channels", False)),
        )

    def describe(self) -> str:
        conv = ", ".join(f"{n} from {m}" for m, n in sorted(self.conversions.items()))
        if self.resize_shorter:
            resize = f"shorter side {self.resize_shorter}, center crop"
        elif self.resize_to is not None:
            resize = f"resized to {self.resize_to[0]}x{self.resize_to[1]}, center crop"
        else:
            resize = "resized"
        if self.resample != BILINEAR:
            resize += f" ({RESAMPLE_NAMES.get(self.resample, self.resample)})"
        if self.flip_channels:
            resize += ", channels flipped to BGR"
        return (
            f"images {resize} to {self.size[0]}x{self.size[1]}, mean {list(self.mean)}, std "
            f"{list(self.std)} ({self.source})" + (f"; converted to {self.mode}: {conv}" if conv else "")
        )


def _pil():
    try:
        from PIL import Image
    except ImportError:
        raise MissingExtraError("image data needs Pillow: pip install 'quantcli[images]'") from None
    return Image


def find_images(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)


def parse_size(text: str | None) -> tuple[int, int] | None:
    """``"224"`` or ``"224x160"`` (height x width) -> (height, width)."""
    if text is None:
        return None
    parts = str(text).lower().split("x")
    try:
        hw = tuple(int(p) for p in parts)
    except ValueError:
        hw = ()
    if len(hw) not in (1, 2) or min(hw) <= 0:
        raise DataError(f"--image-size must be N or HxW in pixels, got {text!r}")
    return (hw[0], hw[0]) if len(hw) == 1 else hw  # type: ignore[return-value]


def parse_floats(text: str | None, option: str) -> tuple[float, ...] | None:
    if text is None:
        return None
    try:
        vals = tuple(float(v) for v in str(text).split(","))
    except ValueError:
        raise DataError(f"{option} must be comma-separated numbers (one per channel), got {text!r}") from None
    if option == "--std" and any(v <= 0 for v in vals):
        raise DataError(f"--std values must be positive, got {text!r}")
    return vals


def _hw(v: Any) -> tuple[int, int] | None:
    if isinstance(v, int):
        return (v, v)
    if isinstance(v, dict) and "height" in v and "width" in v:
        return (int(v["height"]), int(v["width"]))
    return None


#: ConvNextImageProcessor's ``crop_pct`` applies to a ``shortest_edge`` below this
CROP_PCT_BELOW = 384


def _from_preprocessor(cfg: dict[str, Any], where: str = "preprocessor_config.json") -> ImageSettings:
    """The settings a Hugging Face image processor's config describes: ``size`` as ``{height, width}`` (a
    resize to it) or ``{shortest_edge}`` (the shorter side to it, the aspect kept), then with
    ``do_center_crop`` a center crop to ``crop_size``; ``resample`` the filter; normalisation and rescale."""
    size, shorter, resize_to, crop = None, None, None, False
    raw = cfg.get("size")
    if cfg.get("do_resize", True) and raw is not None:
        size = _hw(raw)
        if size is None and isinstance(raw, dict) and "shortest_edge" in raw:
            shorter = int(raw["shortest_edge"])
            size = (shorter, shorter)
    if cfg.get("do_center_crop") and _hw(cfg.get("crop_size")) is not None:
        resize_to = size if shorter is None else None  # None and None: a crop of the image as it is
        size, crop = _hw(cfg["crop_size"]), True
    elif shorter is not None and isinstance(cfg.get("crop_pct"), (int, float)) and cfg["crop_pct"] > 0:
        # ConvNextImageProcessor: below 384, the shorter side to shortest_edge / crop_pct, then a center crop
        # to shortest_edge; from 384, a resize to shortest_edge square (no crop)
        if shorter < CROP_PCT_BELOW:
            shorter, crop = int(shorter / cfg["crop_pct"]), True
        else:
            shorter, resize_to = None, size
    resample = cfg.get("resample", BILINEAR)
    if not isinstance(resample, int) or resample not in RESAMPLE_NAMES:
        raise DataError(f"{where}: resample {resample!r} is not one of PIL's filters (0-5)")
    normalize = cfg.get("do_normalize", True)
    mean = tuple(cfg.get("image_mean", IMAGENET_MEAN)) if normalize else (0.0,)
    std = tuple(cfg.get("image_std", IMAGENET_STD)) if normalize else (1.0,)
    rescale = float(cfg.get("rescale_factor", 1 / 255)) if cfg.get("do_rescale", True) else 1.0
    return ImageSettings(
        size or IMAGENET_SIZE,
        mean,
        std,
        shorter,
        rescale,
        f"from {where}",
        resize_to=resize_to,
        crop=crop,
        resample=resample,
        flip_channels=bool(cfg.get("do_flip_channel_order", False)),
    )


#: largest difference of a probe image's pixel values (normalised) from the folder's own image processor's
#: that counts as equal (float32 rounding of the normalisation; a different resize or crop moves values by ~1)
PROCESSOR_TOLERANCE = 1e-3


def _image_processor(folder: Path):
    """The folder's image processor as transformers builds it (its PIL backend, as quantcli resizes with
    PIL), or None where transformers is missing or cannot build it offline."""
    try:
        from quantcli.inputs.hf_model import transformers_module

        auto = transformers_module().AutoImageProcessor
    except Exception:
        return None
    for kwargs in ({"backend": "pil"}, {"use_fast": False}):
        try:
            return auto.from_pretrained(str(folder), local_files_only=True, **kwargs)
        except Exception:
            continue
    return None


#: the switches of an image processor, read from the processor (None, a switch its class leaves unset, is off)
_SWITCHES = ("do_resize", "do_center_crop", "do_rescale", "do_normalize", "do_flip_channel_order")


def _as_processor_reads(cfg: dict[str, Any], processor) -> dict[str, Any]:
    """``preprocessor_config.json`` as its processor reads it: a legacy integer ``size`` in the form its class
    gives it (the shorter side for CLIP's, a square for ViT's), and each switch as the processor holds it
    (MobileViT's processor never normalises: it has no ``do_normalize`` set)."""
    out = {**cfg, **json.loads(json.dumps(processor.to_dict(), default=list))}
    for k in _SWITCHES:
        if hasattr(processor, k):
            out[k] = bool(getattr(processor, k))
    return out


def _probe_images():
    """Two seeded RGB images, one wider and one taller than square (a resize that does not keep the
    aspect ratio, a crop off-centre by a pixel, show on them)."""
    Image = _pil()
    g = np.random.default_rng(0)
    shapes = ((61, 97, 3), (97, 61, 3))
    return [Image.fromarray(g.integers(0, 256, shape, dtype=np.uint8)) for shape in shapes]


def _check_against(processor, settings: ImageSettings, where: Path) -> None:
    """Refuse settings that do not reproduce the folder's own image processor on probe images: quantcli
    reads a processor's resize, center crop, rescale, normalisation and channel order; others (LeViT's
    resize by 256/224, PoolFormer's crop_pct with crop_size, EfficientNet's rescale_offset, no resize at
    all) would calibrate and verify on other pixels than the deployed model gets, and verify could not
    tell."""
    mean = np.asarray(settings.mean, np.float32).reshape(-1, 1, 1)
    std = np.asarray(settings.std, np.float32).reshape(-1, 1, 1)
    for im in _probe_images():
        try:
            want = np.asarray(processor(images=im, return_tensors="np")["pixel_values"][0], np.float32)
        except Exception:
            return  # the processor does not run here: nothing to compare with
        got = (_pixels(im.copy(), settings) * np.float32(settings.rescale) - mean) / std
        if got.shape != want.shape:
            made = f"{want.shape[-2]}x{want.shape[-1]}"
            gap = f"it makes {made} pixel values, quantcli {got.shape[-2]}x{got.shape[-1]}"
        elif float(np.abs(got - want).max()) > PROCESSOR_TOLERANCE:
            gap = f"their pixel values differ by up to {float(np.abs(got - want).max()):.3g}"
        else:
            continue
        raise DataError(
            f"{where}: {type(processor).__name__} preprocesses images in a way quantcli's image folders do "
            f"not ({gap} on a probe image); pass the images preprocessed instead: an .npz of pixel_values "
            "made by the model's image processor (or --image-size/--mean/--std to choose the preprocessing)"
        )


def _config_image_size(path: Path) -> tuple[int, int] | None:
    """``image_size`` of a Hugging Face ``config.json`` (an int or ``[height, width]``), or None."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8")).get("image_size")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return None
    if isinstance(raw, int) and raw > 0:
        return (raw, raw)
    if isinstance(raw, list) and len(raw) == 2 and all(isinstance(v, int) and v > 0 for v in raw):
        return (raw[0], raw[1])
    return None


def image_settings(
    model_folder: str | Path | None,
    size: tuple[int, int] | None,
    mean: tuple | None,
    std: tuple | None,
    stored: dict[str, Any] | None = None,
) -> ImageSettings:
    """Options win, then what a checkpoint stored, then ``preprocessor_config.json``, then ImageNet's."""
    if stored is not None:
        base = ImageSettings.from_plain(stored)
    else:
        base = ImageSettings(IMAGENET_SIZE, IMAGENET_MEAN, IMAGENET_STD)
        pre = Path(model_folder) / "preprocessor_config.json" if model_folder else None
        if pre is not None and pre.is_file():
            try:
                cfg = json.loads(pre.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
                raise DataError(f"{pre} is not valid JSON: {first_line(e)}") from None
            processor = _image_processor(Path(model_folder))
            if processor is not None:
                cfg = _as_processor_reads(cfg, processor)
            base = _from_preprocessor(cfg, pre.name)
            if processor is not None:
                _check_against(processor, base, pre)
        elif model_folder:  # a folder without one: the size its config.json says the model takes
            size = _config_image_size(Path(model_folder) / "config.json")
            if size is not None:
                base.size, base.source = size, "config.json's image_size, ImageNet's mean and std"
    given = [n for n, v in (("--image-size", size), ("--mean", mean), ("--std", std)) if v is not None]
    if given:
        base.source = f"{', '.join(given)} given; the rest {base.source}"
    if size is not None:  # a direct resize to the size given
        base.size, base.resize_shorter, base.resize_to, base.crop = size, None, None, False
    base.mean = mean if mean is not None else base.mean
    base.std = std if std is not None else base.std
    return base


def model_channels(model: nn.Module) -> int:
    """Channels the model takes: a Hugging Face config's ``num_channels``, else the first Conv2d's, else 3."""
    cfg = getattr(model, "config", None)
    if cfg is not None and isinstance(getattr(cfg, "num_channels", None), int):
        return cfg.num_channels
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            return m.in_channels
    return 3


def _decode(path: Path, mode: str, settings: ImageSettings) -> np.ndarray:
    Image = _pil()
    try:
        with Image.open(path) as im:
            im.load()
            if im.mode not in _CONVERTIBLE:
                raise DataError(
                    f"image {path} has mode {im.mode} (16-bit or float pixels); save it as 8-bit "
                    "RGB or grayscale"
                )
            if im.mode != mode:
                settings.conversions[im.mode] = settings.conversions.get(im.mode, 0) + 1
                im = im.convert(mode)
            else:
                im = im.copy()
    except DataError:
        raise
    except Exception as e:
        raise DataError(f"cannot decode image {path}: {first_line(e, 160)}") from None
    return _pixels(im, settings)


def _pixels(im, settings: ImageSettings) -> np.ndarray:
    """A decoded PIL image resized and cropped as ``settings`` say: float32 ``(C, H, W)`` pixel values."""
    h, w = settings.size
    if settings.resize_shorter:  # as transformers' get_resize_output_image_size: the longer side truncated
        s = settings.resize_shorter
        if im.width <= im.height:
            new_w, new_h = s, int(s * im.height / im.width)
        else:
            new_w, new_h = int(s * im.width / im.height), s
        im = im.resize((new_w, new_h), settings.resample)
    elif settings.resize_to is not None:
        im = im.resize((settings.resize_to[1], settings.resize_to[0]), settings.resample)
    elif not settings.crop:
        im = im.resize((w, h), settings.resample)
    if settings.crop:  # as transformers' center_crop; PIL fills what lies outside a small image with 0
        left, top = (im.width - w) // 2, (im.height - h) // 2
        im = im.crop((left, top, left + w, top + h))
    a = np.asarray(im, dtype=np.float32)
    a = a[None] if a.ndim == 2 else a.transpose(2, 0, 1)
    return a[::-1].copy() if settings.flip_channels and a.shape[0] == 3 else a


def image_batches(
    folder: Path,
    model: nn.Module,
    input_name: str,
    settings: ImageSettings,
    batch_size: int,
    num_samples: int | None,
    shard: tuple[int, int] | None = None,
) -> list[dict[str, torch.Tensor]]:
    """Decode, resize and normalise every image under ``folder``: ``{input_name: float32 (B, C, H, W)}``
    batches. ``shard=(rank, world_size)``: only batches ``rank, rank + world_size, ...`` (the others are not
    decoded)."""
    _pil()
    files = find_images(folder)
    if not files:
        raise DataError(f"data directory {folder} has no .npz, .npy, .pt files nor JPEG/PNG images")
    if num_samples is not None:
        files = files[:num_samples]
    channels = model_channels(model)
    if channels not in (1, 3):
        raise DataError(
            f"the model takes {channels}-channel images; image folders give 1 (L) or 3 (RGB) channels"
        )
    mode = settings.mode = "RGB" if channels == 3 else "L"
    if channels == 1:  # each default left as it is becomes its luma value (--mean alone keeps the std's)
        if tuple(settings.mean) == IMAGENET_MEAN:
            settings.mean = IMAGENET_MEAN_L
        if tuple(settings.std) == IMAGENET_STD:
            settings.std = IMAGENET_STD_L
    mean = np.asarray(settings.mean, np.float32)
    std = np.asarray(settings.std, np.float32)
    for name, v in (("--mean", mean), ("--std", std)):
        if v.size not in (1, channels):
            raise DataError(f"{name} has {v.size} values, but the model takes {channels}-channel images")
    mean, std = mean.reshape(-1, 1, 1), std.reshape(-1, 1, 1)
    batches = []
    starts = range(0, len(files), batch_size)
    for i in starts if shard is None else starts[shard[0] :: shard[1]]:
        arr = np.stack([_decode(f, mode, settings) for f in files[i : i + batch_size]])
        arr = (arr * np.float32(settings.rescale) - mean) / std
        batches.append({input_name: torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32))})
    return batches
