"""What each sequence of a vision-language workload shows the tower (``--images``, ``--video-frames``,
``--image-size``): ``Media``, its checks against the model's processor, and the size parser. Below both
:mod:`.workload` (a workload holds its media) and :mod:`.vision` (the tower's cost).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..model.shapes import ModelShape, VisionShape


@dataclass(frozen=True)
class Media:
    """What each sequence shows the tower: ``images`` images, then one video of ``video_frames`` frames, every
    frame ``height x width`` pixels as the model's processor resized it."""

    images: int = 0
    height: int = 448
    width: int = 448
    video_frames: int = 0  # 0: no video

    def __post_init__(self) -> None:
        counts = (self.images, self.video_frames)
        if min(counts) < 0 or not any(counts) or min(self.height, self.width) < 1:
            raise ValueError(f"--images {self.images}, --video-frames {self.video_frames}, --image-size {self.height}x"
                             f"{self.width}: give an image or a video, no negative count, sizes in positive pixels.")

    def frames(self, v: VisionShape) -> int:
        """Frames the tower sees per sequence: one per image, one per ``temporal`` frames of the video."""
        return self.images + self.video_frames // v.temporal

    def frame_patches(self, v: VisionShape) -> int:
        return (self.height // v.patch) * (self.width // v.patch)

    def tokens(self, v: VisionShape) -> int:
        """Placeholder tokens per sequence: one per merged unit of ``merge**2`` patches (LLaVA's "full": and the
        class token)."""
        return self.frames(v) * (self.frame_patches(v) // v.merge ** 2 + v.routes_class)

    def check(self, model: ModelShape, seq_len: int) -> None:
        """Raise a ValueError naming the fix when the model has no tower, a size is not its processor's or the tokens
        do not fit."""
        v = model.vision
        if v is None:
            raise ValueError(f"--images / --video-frames need a vision-language model; {model.name} has no vision "
                             "tower (presets: qwen2.5-vl-7b, qwen3-vl-8b, or a Qwen-VL config.json).")
        if v.fixed_size:  # the processor resizes every image (InternVL: cuts every tile) to one size
            if self.video_frames or (self.height, self.width) != (v.image_size, v.image_size):
                raise ValueError(f"{model.name}'s tower takes images of {v.image_size}x{v.image_size} px only (InternVL: "
                                 f"--images counts tiles); drop --video-frames and give --image-size "
                                 f"{v.image_size}x{v.image_size} or leave it out.")
        side = v.patch * v.merge
        if self.height % side or self.width % side:
            near = lambda x: max(side, round(x / side) * side)  # noqa: E731
            raise ValueError(f"--image-size {self.height}x{self.width}: {model.name}'s processor resizes to multiples "
                             f"of patch x merge = {side} pixels; use {near(self.height)}x{near(self.width)}.")
        if self.video_frames % v.temporal:
            low = self.video_frames // v.temporal * v.temporal
            raise ValueError(f"--video-frames {self.video_frames} is not a multiple of the {v.temporal} frames of a "
                             f"temporal patch; use {' or '.join(str(f) for f in (low, low + v.temporal) if f)}.")
        if self.tokens(v) > seq_len:
            per = f"{self.frame_patches(v) // v.merge ** 2:,} tokens"
            parts = ([f"{self.images} images x {per}"] if self.images else []) + (
                [f"a video of {self.video_frames // v.temporal} frames x {per}"] if self.video_frames else [])
            raise ValueError(f"{' + '.join(parts)} = {self.tokens(v):,} placeholder tokens do not fit in --seq-len "
                             f"{seq_len:,}; use --seq-len {self.tokens(v):,} or more, or fewer or smaller images.")


def add_media_flags(p, *, video: bool = True) -> None:
    """``--images``, ``--image-size`` and (``video``) ``--video-frames``, as ``seqmesh plan`` and ``seqmesh rehearse``
    take them."""
    p.add_argument("--images", type=int, default=0, help="images per sequence, for a vision-language model's tower")
    p.add_argument("--image-size", metavar="HxW", help="pixels of each image and video frame, multiples of patch x "
                   "merge (default 448x448; LLaVA, Gemma 3, InternVL: their tower's one size)")
    if video:
        p.add_argument("--video-frames", type=int, default=0,
                       help="frames of one video per sequence (default 0: none)")


def media_from_flags(model: ModelShape, images: int, image_size: str | None, video_frames: int = 0) -> Media | None:
    """The :class:`Media` those flags describe for ``model`` (None: no image and no video); the size defaults to the
    tower's one size (LLaVA, Gemma 3, InternVL), else 448x448."""
    if not (images or video_frames):
        if image_size:
            raise ValueError(f"--image-size {image_size} without an image or a video: give --images N (or "
                             "--video-frames N), or drop --image-size.")
        return None
    fixed = model.vision is not None and model.vision.fixed_size
    size = image_size or (f"{model.vision.image_size}x{model.vision.image_size}" if fixed else "448x448")
    return Media(images, *parse_image_size(size), video_frames)


def parse_image_size(text: str) -> tuple[int, int]:
    """``HEIGHTxWIDTH`` in pixels -> ``(height, width)``."""
    try:
        height, width = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"--image-size {text!r} must look like HEIGHTxWIDTH in pixels, e.g. 448x448.") from None
    return height, width
