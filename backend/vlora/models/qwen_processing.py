"""Qwen2-VL's processor without torchvision: transformers 5's ``Qwen2VLVideoProcessor`` needs torchvision,
and ``AutoProcessor`` builds it even for image-only use. Where torchvision is missing, the processor is
composed from the folder's own files (image processor, tokenizer, chat template) with
:class:`QwenVideoProcessorPil`, which follows the video processor's resize rule and patch layout.

Why torchvision is not simply a dependency (tried 2026-11-29): the CPU install pins torch 2.13.0+cpu, and the
package index the CI installs from holds only the CUDA build of the matching torchvision (0.28.0, manylinux
x86-64), whose C++ operators fail to load against the CPU torch (``operator torchvision::nms does not exist``); a
newer torchvision would pull a newer torch. GPU machines have torchvision, and there ``AutoProcessor`` serves."""
from __future__ import annotations

import json
from pathlib import Path

import torch

# Defaults of the video processor where its config leaves them out (Qwen2-VL's).
PATCH_SIZE = 14
MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2
VIDEO_MIN_PIXELS = 128 * 28 * 28
VIDEO_MAX_PIXELS = 768 * 28 * 28
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def load_qwen_processor(model_dir: Path):
    """The folder's ``Qwen2VLProcessor`` / ``Qwen2_5_VLProcessor``, loaded offline.

    ``AutoProcessor`` builds transformers' video processor, which needs torchvision. Without
    torchvision the processor is composed here instead, from the same files: the image processor
    (transformers' PIL backend), the tokenizer with its chat template, and :class:`QwenVideoProcessorPil`.
    """
    import transformers
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer
    from transformers.utils import is_torchvision_available

    model_dir = Path(model_dir)
    if is_torchvision_available():
        return AutoProcessor.from_pretrained(model_dir, local_files_only=True)
    if QwenVideoProcessorPil.__bases__ == (object,):  # see _video_processor_base
        raise ImportError(f"the Qwen2-VL processor needs torchvision under transformers {transformers.__version__}")
    config = json.loads((model_dir / "preprocessor_config.json").read_text(encoding="utf-8"))
    processor_class = _accepting_pil_video(getattr(transformers, config.get("processor_class", "Qwen2VLProcessor")))
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    return processor_class(
        image_processor=AutoImageProcessor.from_pretrained(model_dir, local_files_only=True),
        tokenizer=tokenizer,
        # Older checkpoints keep the video settings in preprocessor_config.json.
        video_processor=QwenVideoProcessorPil.from_config_file(
            model_dir / "video_preprocessor_config.json" if (model_dir / "video_preprocessor_config.json").is_file()
            else model_dir / "preprocessor_config.json"),
        chat_template=tokenizer.chat_template,
    )


def _accepting_pil_video(processor_class):
    """``processor_class``, except that its constructor accepts a :class:`QwenVideoProcessorPil`.

    (ProcessorMixin checks each part against transformers' base classes, looked up in registries that
    are placeholders when torchvision is missing.)
    """

    class Processor(processor_class):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and isinstance(argument, QwenVideoProcessorPil):
                return QwenVideoProcessorPil
            return super().check_argument_for_proper_class(argument_name, argument)

    Processor.__name__ = Processor.__qualname__ = processor_class.__name__
    return Processor


def _video_processor_base():
    try:
        from transformers.video_processing_utils import VideoProcessorMixin
    except ImportError:  # older transformers 5 (5.17): no video processor base without torchvision
        return object
    return VideoProcessorMixin


class QwenVideoProcessorPil(_video_processor_base()):
    """``Qwen2VLVideoProcessor`` without torchvision: same resize rule, frame padding and patch layout.

    Frames are resized with PIL's bicubic filter (torchvision's differs in the last bits), then
    rescaled and normalised; a clip is padded to a multiple of ``temporal_patch_size`` by repeating its
    last frame and flattened into ``[grid_t * grid_h * grid_w, C * temporal_patch_size * patch^2]``.
    Frames are not sampled: every frame given is used.
    """

    model_input_names = ["pixel_values_videos", "video_grid_thw"]
    resample = 3  # PIL.Image.BICUBIC (vlora.models.pixels reproduces this processor on the model's device)
    resizes_with_pillow = True  # vlora.models.pixels.video_fast_path

    def __init__(self, **kwargs):
        size = dict(kwargs.pop("size", None) or {})
        self.min_pixels = int(kwargs.pop("min_pixels", size.get("shortest_edge", VIDEO_MIN_PIXELS)))
        self.max_pixels = int(kwargs.pop("max_pixels", size.get("longest_edge", VIDEO_MAX_PIXELS)))
        self.patch_size = int(kwargs.pop("patch_size", PATCH_SIZE))
        self.temporal_patch_size = int(kwargs.pop("temporal_patch_size", TEMPORAL_PATCH_SIZE))
        self.merge_size = int(kwargs.pop("merge_size", MERGE_SIZE))
        self.rescale_factor = float(kwargs.pop("rescale_factor", 1 / 255))
        self.image_mean = list(kwargs.pop("image_mean", CLIP_MEAN))
        self.image_std = list(kwargs.pop("image_std", CLIP_STD))
        self.size = {"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels}
        super().__init__()

    @classmethod
    def from_config_file(cls, path: Path) -> "QwenVideoProcessorPil":
        config = json.loads(Path(path).read_text(encoding="utf-8"))
        keys = ("size", "min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size",
                "rescale_factor", "image_mean", "image_std")
        return cls(**{k: config[k] for k in keys if k in config})

    def __call__(self, videos, **kwargs):
        return self.preprocess(videos, **kwargs)

    def preprocess(self, videos, video_metadata=None, return_tensors=None, **kwargs):
        """``videos``: one clip or a list of clips; a clip is a list of PIL images or HxWx3 uint8 arrays,
        or a ``[T, H, W, 3]`` uint8 array."""
        from transformers.feature_extraction_utils import BatchFeature
        from transformers.video_utils import make_batched_metadata, make_batched_videos

        clips = make_batched_videos(videos)
        patches, grids = [], []
        for clip in clips:
            flat, grid = self._patchify(self._frames(clip))
            patches.append(flat)
            grids.append(grid)
        data = {"pixel_values_videos": torch.cat(patches), "video_grid_thw": torch.tensor(grids, dtype=torch.int64),
                "video_metadata": make_batched_metadata(clips, video_metadata)}
        return BatchFeature(data, tensor_type=return_tensors)

    def _frames(self, clip) -> torch.Tensor:
        """[T, C, H', W'] float32, resized (to multiples of patch*merge), rescaled and normalised."""
        import numpy as np
        from PIL import Image

        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        images = [f if isinstance(f, Image.Image) else Image.fromarray(np.asarray(f, dtype=np.uint8)) for f in clip]
        if not images:
            raise ValueError("a video needs at least one frame")
        width, height = images[0].size
        rh, rw = smart_resize(height, width, factor=self.patch_size * self.merge_size,
                              min_pixels=self.min_pixels, max_pixels=self.max_pixels)
        arrays = [np.asarray(im.convert("RGB").resize((rw, rh), Image.BICUBIC), dtype=np.float32) for im in images]
        frames = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2) * self.rescale_factor
        mean = torch.tensor(self.image_mean).view(1, 3, 1, 1)
        std = torch.tensor(self.image_std).view(1, 3, 1, 1)
        return (frames - mean) / std

    def _patchify(self, frames: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """As ``Qwen2VLVideoProcessor.patchify``, for one clip."""
        from vlora.models.pixels import patchify

        return patchify(frames, self.patch_size, self.merge_size, self.temporal_patch_size)
