"""The run's data, chosen from its configuration: the copy task, text files packed into rows, the built-in image task
or image records for a vision-language model, or (``seqmesh rehearse --images``) rows showing given images. Every
data and vocabulary error is raised here, before any model is built."""

from __future__ import annotations

import os

from ..rules.positions import position_problem
from ..model.lm import ModelSource, read_model
from ..model.config_json import read_config_json
from ..model.presets import MODELS
from ..model.pretrained import check_tokenizer_path
from ..planner.media import Media
from ..vision.families import family_of, vision_family
from .config import TrainConfig
from .datasets import LongRangeCopy, PackedText, check_data_paths, load_tokenizer, tokenizer_vocab
from .image_files import ImageJsonl
from .vision_data import ImageCopy, ImageRows


def _copy_task(cfg: TrainConfig, vocab: int) -> LongRangeCopy:
    task = LongRangeCopy(cfg.seq_len, symbols=cfg.symbols, period=cfg.copy_period, seed=cfg.seed)
    if task.vocab > vocab:
        raise ValueError(f"the copy task uses {task.vocab} tokens ({cfg.symbols} symbols + 3 reserved) but the model's "
                         f"vocabulary has {vocab}; lower --symbols to {vocab - 3} or use a larger vocabulary.")
    return task


def _tokenizer(cfg: TrainConfig, vocab: int):
    tokenizer = load_tokenizer(cfg.tokenizer)
    if tokenizer_vocab(tokenizer) > vocab:
        raise ValueError(f"the tokenizer has {tokenizer_vocab(tokenizer)} tokens but the model's vocabulary has {vocab}; "
                         "use a model whose vocab_size covers the tokenizer.")
    return tokenizer


def _check_vision_family(model: str) -> None:
    """A vision-language config.json of a family seqmesh does not run (LLaVA-OneVision) refused by that, the true
    reason, before its sizes are read as another family's (and before any advice to train it some other way)."""
    path = os.path.join(model, "config.json") if os.path.isdir(model) else model
    if model in MODELS or not os.path.isfile(path):
        return  # a preset, or no file: model_shape names it
    raw = read_config_json(path)
    if isinstance(raw.get("vision_config"), dict):
        family_of(raw.get("model_type"))


def read_run_model(cfg: TrainConfig) -> ModelSource:
    """``cfg.model`` read once for the whole job (its data, mesh and model); a vision-language family seqmesh does not
    run is refused by that, first."""
    _check_vision_family(cfg.model)
    source = read_model(cfg.model)
    shape = source.shape
    problem = position_problem(cfg.seq_len, shape.position_rows, shape.family)
    if problem:  # before anything is built (past the table: an index out of range in the first step)
        raise ValueError(f"{cfg.model}: {problem}.")
    return source


def make_dataset(cfg: TrainConfig, vocab: int | None = None, media: Media | None = None,
                 source: ModelSource | None = None) -> LongRangeCopy | PackedText | ImageCopy | ImageJsonl | ImageRows:
    """The run's data: the copy task (the image task for a vision-language model), or ``cfg.data`` packed
    into rows. Raises for missing files or tokenizer, or a model vocabulary (``vocab``; by default read
    from ``cfg.model``'s config, no model built) too small for the data. ``train`` and ``verify`` call it
    before building anything; ``seqmesh rehearse --images`` passes ``media``: rows showing those images.
    ``source``: the model as the job read it (:func:`read_run_model`; read here when not given)."""
    source = source if source is not None else read_run_model(cfg)
    shape = source.shape
    if media is not None:
        media.check(shape, cfg.seq_len)  # the planner's own checks: a tower, the processor's sizes, the tokens fit
        if media.video_frames or cfg.data:
            raise ValueError("rehearsed images are rows of images then text: drop --video-frames and --data.")
    if shape.vision is not None and shape.vision.fixed_size:
        config = source.config
        vision_family(config).check(config)  # a setting parallelize_model would refuse: that refusal, not the advice
        raise ValueError(f"{cfg.model}: seqmesh train builds Qwen-VL towers; a {shape.vision.tower} tower (LLaVA, Gemma 3, "
                         "InternVL) trains with seqmesh.compose.parallelize_model in your own loop, or "
                         "seqmesh.trainer.SequenceParallelTrainer; seqmesh plan sizes it.")
    vocab = shape.vocab if vocab is None else vocab
    if shape.vision is not None:  # a vision-language model: your records and images, or the built-in image task
        config = source.config
        if cfg.data:
            check_data_paths(cfg.data)
            return ImageJsonl(cfg.data, cfg.seq_len, _tokenizer(cfg, vocab), config, text_key=cfg.text_key,
                              seed=cfg.seed)
        tokens = (config.image_token_id, config.vision_start_token_id, config.vision_end_token_id)
        if media is not None:
            return ImageRows(cfg.seq_len, shape.vision, tokens, media.images, media.height, media.width, seed=cfg.seed)
        check_tokenizer_path(cfg.tokenizer)
        return ImageCopy(cfg.seq_len, shape.vision, tokens, symbols=cfg.symbols, seed=cfg.seed)
    if not cfg.data:
        check_tokenizer_path(cfg.tokenizer)  # unused by the copy task, but a wrong path is still a mistake
        return _copy_task(cfg, vocab)
    check_data_paths(cfg.data)  # cheaper than loading a tokenizer first
    return PackedText(cfg.data, cfg.seq_len, _tokenizer(cfg, vocab), text_key=cfg.text_key, seed=cfg.seed)
