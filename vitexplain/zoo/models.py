"""Architectures of the bundled zoo models and their default configurations.

Each zoo model is described by a JSON-serialisable config ``{"arch": ..., "model_args": ...}``;
:func:`build` turns a config into an (untrained) ``nn.Module``. The same function builds the
model for training (:mod:`vitexplain.zoo.train`) and for loading (:func:`vitexplain.zoo.load`).

* ``shapes-vit``: a plain timm ``VisionTransformer`` (64 px, patch 8 -> 8 x 8 grid, class token,
  ``global_pool="token"``, default fused attention), multi-label head over ``SHAPES``.
* ``shapes-cnn``: a timm ``ResNet`` of ``BasicBlock`` s whose blocks carry timm attention
  modules (``block.se``), one type per stage (ECA, SE, CBAM, CBAM by default). The stem
  max-pool is removed and the last stage is dilated (``output_stride=16``), so at 64 px input
  the stages run at 32, 16, 8 and 8 px: the CBAM spatial gates of the two deepest stages are
  8 x 8 maps.
* ``shapes-hier``: a hierarchical ViT, a timm ``Hiera`` (the image encoder family of SAM 2;
  :data:`HIERA_GLOBAL_CONFIG`): a non-overlapping 4 x 4 patch embedding with a learned absolute
  position embedding, then three stages on 16 x 16, 8 x 8 and 4 x 4 token grids at 64 px (1, 1 and
  2 blocks; widths 32, 64, 128; 1, 2 and 4 heads); each later stage starts with a block that
  max-pools its queries and residual over 2 x 2 neighbourhoods; global attention in every block
  (``mask_unit_attn`` off); plain MLPs; mean-pooled tokens into the head; default fused attention.
  Its tokens mix across positions only in attention and the 2 x 2 pooling. Multi-label head over
  ``SHAPES``.
* Tried as ``shapes-hier`` before (not bundled; :data:`HIER_VARIANTS`, see
  :mod:`vitexplain.zoo.recipes`): :data:`HIERA_CONFIG`, the same Hiera with mask-unit attention inside
  16 x 16 px windows in its first three blocks (the third, pooling into stage 2, attends from each
  new token to its 2 x 2 children); and :data:`PVT_CONFIG`, a timm ``PyramidVisionTransformerV2``
  (overlapping patch embedding of stride 4, then stages at strides 4, 8, 16 -> 16 x 16, 8 x 8 and
  4 x 4 token grids at 64 px; spatial-reduction attention whose keys and values are pooled by a
  strided conv in the first stage; a depthwise conv in every MLP; mean-pooled tokens into the head).
* ``shapes-captioner``: :class:`vitexplain.zoo.captioner.Captioner`.
* ``shapes-sat``: :class:`vitexplain.zoo.sat.ShowAttendTell` (Show, Attend and Tell: CNN grid
  encoder, LSTM decoder with additive attention).
* ``shapes-vlm``: a Hugging Face ``LlavaForConditionalGeneration`` (:mod:`vitexplain.zoo.vlm`;
  needs transformers).
"""

from __future__ import annotations

import copy
from typing import Any

import torch.nn as nn

from ..data.drawing import COLORS, SHAPES
from ..data.synthetic import MEAN, STD
from ..errors import UsageError

__all__ = ["DEFAULT_CONFIGS", "PVT_CONFIG", "HIERA_CONFIG", "HIERA_GLOBAL_CONFIG", "HIER_VARIANTS", "ARCHS",
           "CAPTION_ARCHS", "build", "caption_words", "pretrained_cfg"]


def caption_words() -> list[str]:
    """Content words of the captioner vocabulary: colors, shapes, "and"."""
    return [*COLORS, *SHAPES, "and"]


DEFAULT_CONFIGS: dict[str, dict[str, Any]] = {
    "shapes-vit": {
        "arch": "vit",
        "model_args": {
            "img_size": 64,
            "patch_size": 8,
            "embed_dim": 96,
            "depth": 4,
            "num_heads": 4,
            "mlp_ratio": 2.0,
            "num_classes": len(SHAPES),
            "global_pool": "token",
            "class_token": True,
        },
    },
    "shapes-cnn": {
        "arch": "cnn",
        "model_args": {
            "layers": [1, 1, 1, 1],
            "channels": [32, 64, 128, 128],
            "stem_type": "deep",
            "stem_width": 16,
            "stem_pool": False,
            "output_stride": 16,
            "stage_attn": ["eca", "se", "cbam", "cbam"],
            "num_classes": len(SHAPES),
        },
    },
    "shapes-captioner": {
        "arch": "captioner",
        "model_args": {
            "words": caption_words(),
            "img_size": 64,
            "patch_size": 8,
            "enc_dim": 96,
            "enc_depth": 4,
            "enc_heads": 4,
            "enc_mlp_ratio": 2.0,
            "dec_dim": 96,
            "dec_depth": 2,
            "dec_heads": 2,
            "dec_mlp_ratio": 2.0,
            "max_len": 12,
        },
    },
    "shapes-sat": {
        "arch": "sat",
        "model_args": {
            "words": caption_words(),
            "img_size": 64,
            "widths": [32, 64, 96, 96, 128],
            "strides": [2, 2, 1, 1, 1],
            "dilations": [1, 1, 1, 2, 2],
            "embed_dim": 64,
            "hidden_dim": 128,
            "attention_dim": 64,
            "dropout": 0.2,
            "context_dropout": 0.5,
            "max_len": 12,
        },
    },
}


#: The PVTv2 bundled as ``shapes-hier`` before the Hiera (not bundled now):
#: ``python -m vitexplain.zoo.train shapes-hier --arch pvt``.
PVT_CONFIG: dict[str, Any] = {
    "arch": "pvt",
    "model_args": {
        "img_size": 64,
        "depths": [1, 1, 2],
        "embed_dims": [32, 64, 128],
        "num_heads": [1, 2, 4],
        "sr_ratios": [2, 1, 1],
        "mlp_ratios": [2.0, 2.0, 2.0],
        "num_classes": len(SHAPES),
    },
}

#: A Hiera with mask-unit attention, tried as ``shapes-hier`` (not bundled):
#: ``python -m vitexplain.zoo.train shapes-hier --arch hiera``.
HIERA_CONFIG: dict[str, Any] = {
    "arch": "hiera",
    "model_args": {
        "img_size": 64,
        "embed_dim": 32,
        "num_heads": 1,
        "stages": [1, 1, 2],
        "q_pool": 2,
        "mask_unit_size": [4, 4],
        "mask_unit_attn": [True, True, False],
        "patch_kernel": [4, 4],
        "patch_stride": [4, 4],
        "patch_padding": [0, 0],
        "mlp_ratio": 2.0,
        "num_classes": len(SHAPES),
    },
}


#: The bundled ``shapes-hier``: the same Hiera with global attention in every block
#: (``mask_unit_attn`` False in every stage; the blocks pooling into stages 1 and 2 then attend from
#: each new token to all the previous stage's tokens, not to the 2 x 2 children inside its 16 x 16 px
#: mask unit): ``--arch hiera-global`` (the default).
HIERA_GLOBAL_CONFIG: dict[str, Any] = {
    "arch": "hiera",
    "model_args": {**HIERA_CONFIG["model_args"], "mask_unit_attn": [False, False, False]},
}

#: The variants ``shapes-hier`` can be trained as (``python -m vitexplain.zoo.train shapes-hier --arch NAME``);
#: the first is the bundled one.
HIER_VARIANTS: dict[str, dict[str, Any]] = {"hiera-global": HIERA_GLOBAL_CONFIG, "hiera": HIERA_CONFIG,
                                            "pvt": PVT_CONFIG}
DEFAULT_CONFIGS["shapes-hier"] = copy.deepcopy(HIERA_GLOBAL_CONFIG)


def _build_vit(args: dict[str, Any]) -> nn.Module:
    from timm.models.vision_transformer import VisionTransformer

    return VisionTransformer(**args)


def _build_cnn(args: dict[str, Any]) -> nn.Module:
    from timm.layers import create_attn
    from timm.models.resnet import BasicBlock, ResNet

    args = dict(args)
    stage_attn = list(args.pop("stage_attn"))
    stem_pool = bool(args.pop("stem_pool", True))
    if len(stage_attn) != len(args["layers"]):
        raise UsageError("stage_attn needs one attention type (or None) per stage")
    model = ResNet(
        BasicBlock,
        layers=tuple(args.pop("layers")),
        channels=tuple(args.pop("channels")),
        **args,
    )
    for s, attn in enumerate(stage_attn):
        stage = getattr(model, f"layer{s + 1}")
        for block in stage:
            # timm's own modules (EcaModule, SEModule, CbamModule), as attn_layer would create them
            block.se = create_attn(attn, block.conv2.out_channels) if attn else None
    if not stem_pool:
        model.maxpool = nn.Identity()
        for info in model.feature_info:
            if info["reduction"] > 2:
                info["reduction"] //= 2
    return model


def _build_pvt(args: dict[str, Any]) -> nn.Module:
    from timm.models.pvt_v2 import PyramidVisionTransformerV2

    args = dict(args)
    args.pop("img_size", None)  # PVTv2 takes any size; kept in the config for the preprocessing
    tuples = {k: tuple(args.pop(k)) for k in ("depths", "embed_dims", "num_heads", "sr_ratios", "mlp_ratios")}
    return PyramidVisionTransformerV2(**tuples, **args)


def _build_hiera(args: dict[str, Any]) -> nn.Module:
    from timm.models.hiera import Hiera

    args = dict(args)
    for k in ("stages", "mask_unit_size", "mask_unit_attn", "patch_kernel", "patch_stride", "patch_padding"):
        args[k] = tuple(args[k])
    return Hiera(**args)


def _build_captioner(args: dict[str, Any]) -> nn.Module:
    from .captioner import Captioner

    return Captioner(**args)


def _build_sat(args: dict[str, Any]) -> nn.Module:
    from .sat import ShowAttendTell

    return ShowAttendTell(**args)


def _build_llava(args: dict[str, Any]) -> nn.Module:
    from .vlm import build_llava

    return build_llava(args)


ARCHS = {"vit": _build_vit, "cnn": _build_cnn, "pvt": _build_pvt, "hiera": _build_hiera, "captioner": _build_captioner,
         "sat": _build_sat, "llava": _build_llava}

#: Architectures that write captions (their labels are the vocabulary).
CAPTION_ARCHS = ("captioner", "sat", "llava")


def build(config: dict[str, Any]) -> nn.Module:
    """Build an untrained model from a zoo config.

    Args:
        config: ``{"arch": "vit" | "cnn" | "pvt" | "hiera" | "captioner" | "sat" | "llava", "model_args": {...}}``.

    Returns:
        The model (train mode, random init).
    """
    arch = config.get("arch")
    if arch not in ARCHS:
        raise UsageError(f"unknown zoo architecture {arch!r}; expected one of {sorted(ARCHS)}")
    return ARCHS[arch](copy.deepcopy(config["model_args"]))


def pretrained_cfg(config: dict[str, Any]) -> dict[str, Any]:
    """The timm-style preprocessing config of a zoo model.

    Returns:
        ``{"input_size": (3, H, W), "mean", "std", "interpolation", "crop_pct", "label_names",
        "num_classes", ...}``; ``timm.data.resolve_data_config(model=model)`` reads it.
    """
    args = config["model_args"]
    size = int(args.get("img_size", 64))
    if config["arch"] == "llava":
        from .vlm import SPECIALS

        labels = [*SPECIALS, *args["words"]]
    elif config["arch"] in CAPTION_ARCHS:
        from .captioner import BOS, EOS, PAD

        labels = [PAD, BOS, EOS, *args["words"]]
    else:
        labels = list(SHAPES)
    return {
        "input_size": (3, size, size),
        "mean": tuple(MEAN),
        "std": tuple(STD),
        "interpolation": "bilinear",
        "crop_pct": 1.0,
        "crop_mode": "center",
        "label_names": labels,
        "num_classes": len(labels),
        "multi_label": config["arch"] not in CAPTION_ARCHS,
    }
