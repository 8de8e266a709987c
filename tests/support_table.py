"""The support matrix: a tiny random-init build of every model family, and a sweep over methods.

A test and documentation harness, not part of the package. One table (:func:`rows`) feeds
both the sweep test (``tests/test_support_matrix.py``), which asserts that every method the
model's plan lists (``vx.Explainer(model).methods()``) gives a finite map per image or raises a
:class:`~vitexplain.errors.VitexplainError`, and that every method the plan refuses says why,
and the script that writes the support matrix, ``docs/support.md``
(``python tools/support_matrix.py``).
Each family names the test that checks its maps against an independent oracle.

Builds are tiny (a few blocks of width 32, 32-64 px inputs) and offline (random init). Heads
that libraries initialise to zero (torchvision ViT) and residual branches that end in a
zero-initialised norm (timm ResNets' ``zero_init_last``) make gradient maps constant; the
sweep re-initialises them (:func:`reinit_heads`) so that a constant map means a bug.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

import vitexplain as vx
from vitexplain.errors import VitexplainError
from vitexplain.methods import CNN, Family
from vitexplain.plan import applicable

__all__ = ["Row", "Outcome", "Sweep", "rows", "run", "reinit_heads", "CHEAP"]

#: Cheap options for the slow methods (the sweep checks plumbing, not quality).
CHEAP: dict[str, dict[str, Any]] = {
    "cdam_smooth": {"samples": 3},
    "cdam_integrated": {"steps": 3},
    # from the zero baseline many tiny random-init builds (zero biases, a norm right after the patch embedding) change
    # their score only before IG's first point at 3 steps, which IG refuses (tests/test_ig_flat_path.py); a grey
    # baseline moves them along the whole path
    "integrated_gradients": {"steps": 3, "baseline": 0.5},
    "smoothgrad": {"samples": 2},
}


@dataclass(frozen=True)
class Row:
    """One row of the support matrix: a model family as the support matrix names it.

    Attributes:
        name: how the support matrix names it.
        group: ``"ViT"``, ``"Hugging Face"``, ``"CNN"``, ``"hybrid"``, ``"hierarchical"``, ``"captioner"``,
            ``"Swin"``, ``"VLM"``.
        build: returns the tiny model (random init, offline; in training mode as built: the sweep calls eval()).
        size: (H, W) of the inputs.
        oracle: the test that checks this family's maps against an independent oracle.
        target: ``"norm"`` for headless backbones (explained with ``vx.targets.norm()``).

    A vision-language row's ``build`` returns ``(model, processor)``; it is explained on uint8 images
    of ``size`` with a prompt.
        options: per method, options of this row's sweep (over :data:`CHEAP`).
    """

    name: str
    group: str
    build: Callable[[], Any]
    size: tuple[int, int]
    oracle: str
    target: Optional[str] = None
    options: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass
class Outcome:
    """What one method did on one family.

    Attributes:
        method: the method name.
        status: ``"ok"`` (listed, ran, finite, right shape), ``"refused"`` (listed, raised a
            VitexplainError), or ``"n/a"`` (not listed for this model; ``detail`` says why).
        detail: the error or refusal message, or the map shape (prefixed "zero " when every
            value is 0).
        std: standard deviation of the maps (ok only): 0 means a constant map.
    """

    method: str
    status: str
    detail: str = ""
    std: float = field(default=float("nan"))


# -- builders ----------------------------------------------------------------------------------
def _timm(name: str, **kwargs: Any) -> nn.Module:
    import timm

    return timm.create_model(name, pretrained=False, **kwargs)


_VIT = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5)


def _timm_vit(**kwargs: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from timm.models.vision_transformer import VisionTransformer

        return VisionTransformer(**{**_VIT, **kwargs})

    return build


def _timm_class(module: str, cls: str, **kwargs: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import importlib

        return getattr(importlib.import_module(f"timm.models.{module}"), cls)(**kwargs)

    return build


_HF = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32, patch_size=8)


def _open_clip_tower() -> nn.Module:
    from open_clip.transformer import VisionTransformer

    return VisionTransformer(image_size=32, patch_size=8, width=32, layers=2, heads=2, mlp_ratio=2.0, output_dim=16)


def _hf_cnn(config: str, model: str, **kwargs: Any) -> Callable[[], nn.Module]:
    """A Hugging Face model built from ``kwargs`` only (not the ViT sizes ``_hf`` adds: CNNs, SAM 3's backbone)."""
    def build() -> nn.Module:
        import transformers

        return getattr(transformers, model)(getattr(transformers, config)(**kwargs))

    return build


def _hf(config: str, model: str, **kwargs: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import transformers

        cfg = getattr(transformers, config)(**{**_HF, **kwargs})
        return getattr(transformers, model)(cfg)

    return build


def _torchvision_vit() -> nn.Module:
    import torchvision

    return torchvision.models.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64, num_classes=5)


def _torchvision_maxvit() -> nn.Module:
    import torchvision

    return torchvision.models.MaxVit(
        input_size=(64, 64), stem_channels=16, partition_size=2, block_channels=[16, 32], block_layers=[1, 1],
        head_dim=8, stochastic_depth_prob=0.0, num_classes=5,
    )


def _torchvision_mobilenet() -> nn.Module:
    import torchvision

    return torchvision.models.mobilenet_v3_small(num_classes=5)


class _Normalize(nn.Module):
    """A normalisation layer users put in front of a classifier."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - 0.45) / 0.225


def _torchvision_resnet(wrapped: bool = False, headless: bool = False) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import torchvision

        model = torchvision.models.resnet18(num_classes=5)
        if headless:
            model.fc = nn.Identity()
        return nn.Sequential(_Normalize(), model) if wrapped else model

    return build


def _maxvit() -> nn.Module:
    from timm.models.maxxvit import MaxxVit, MaxxVitCfg, MaxxVitTransformerCfg

    cfg = MaxxVitCfg(
        embed_dim=(16, 32), depths=(1, 1), block_type=("M", "M"), stem_width=16,
        transformer_cfg=MaxxVitTransformerCfg(dim_head=8, window_size=(4, 4), grid_size=(4, 4)),
    )
    return MaxxVit(cfg, img_size=64, num_classes=5)


def _levit_gains(model: nn.Module) -> nn.Module:
    """``model`` (a timm or Hugging Face LeViT) with its linear and conv weights drawn N(0, 1 / fan_in) and its
    attention biases N(0, 1) (its attention-bias cache cleared), in place."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.Linear, nn.Conv2d)):
                module.weight.normal_(0, module.weight[0].numel() ** -0.5)
            if isinstance(getattr(module, "attention_biases", None), nn.Parameter):
                module.attention_biases.normal_(0, 1)
                module.attention_bias_cache = {}
    return model


def _levit_conv() -> nn.Module:
    """``_levit`` in conv mode (``levit_conv_*``: (B, C, H, W) maps, 1 x 1 convs), with the same gains."""
    from timm.models.levit import LevitDistilled

    model = LevitDistilled(img_size=128, embed_dim=(32, 48, 64), key_dim=8, depth=(1, 1, 1), num_heads=(2, 2, 2),
                           num_classes=5, use_conv=True)
    return _levit_gains(model)


def _halonet() -> nn.Module:
    """A tiny timm HaloNet (``ByobNet`` with ``self_attn_layer="halo"``, as ``halonet26t`` but 2 halo stages of 4 x 4
    blocks with a halo of 1) at 64 px: feature maps 8 x 8 and 4 x 4."""
    from timm.models.byobnet import ByobNet, ByoBlockCfg, ByoModelCfg

    cfg = ByoModelCfg(
        blocks=(ByoBlockCfg(type="bottle", d=1, c=32, s=1, gs=0, br=0.25),
                ByoBlockCfg(type="self_attn", d=1, c=64, s=2, gs=0, br=0.25),
                ByoBlockCfg(type="self_attn", d=1, c=64, s=2, gs=0, br=0.25)),
        stem_chs=16, stem_type="tiered", stem_pool="maxpool", self_attn_layer="halo",
        self_attn_kwargs=dict(block_size=4, halo_size=1, num_heads=2))
    return ByobNet(cfg, num_classes=5)


def _levit() -> nn.Module:
    """A tiny LeViT whose linear and conv layers get N(0, 1 / fan_in) and attention biases N(0, 1):
    with timm's init (zero biases) each subsampling attention is near uniform, its outputs near
    identical, and by the last stage every token is the same (std 2e-9): every map there is flat."""
    from timm.models.levit import LevitDistilled

    model = LevitDistilled(img_size=128, embed_dim=(32, 48, 64), key_dim=8, depth=(1, 1, 1), num_heads=(2, 2, 2),
                           num_classes=5)
    return _levit_gains(model)


def _hf_levit(model: str, depths: Sequence[int] = (1, 1, 1)) -> Callable[[], nn.Module]:
    """A tiny Hugging Face LeViT at 128 px (grids 8 x 8, 4 x 4, 2 x 2) with ``_levit``'s gains, for
    the same reason (Hugging Face's init also leaves attention biases zero)."""
    def build() -> nn.Module:
        import transformers

        config = transformers.LevitConfig(image_size=128, hidden_sizes=[32, 48, 64], num_attention_heads=[2, 2, 2],
                                          depths=list(depths), key_dim=[8, 8, 8], num_labels=5)
        built = getattr(transformers, model)(config)
        return _levit_gains(built)

    return build


def hf_sam2_hiera_config() -> Any:
    """SAM 2's Hiera backbone, tiny, at 64 px: grids 16 x 16, 8 x 8, 4 x 4; windows of 4 (block 0),
    pooled in windows of 4 -> 2 (block 1), windows of 2 (block 2), pooled in windows of 2 -> 1
    (block 3), zero-padded windows of 3 on the 4 x 4 grid (block 4), global attention (block 5)."""
    import transformers

    return transformers.Sam2HieraDetConfig(
        image_size=[64, 64], hidden_size=16, embed_dim_per_stage=[16, 32, 64], blocks_per_stage=[1, 2, 3],
        num_attention_heads_per_stage=[1, 2, 4], window_size_per_stage=[4, 2, 3], global_attention_blocks=[5],
        num_query_pool_stages=2, window_positional_embedding_background_size=[4, 4], mlp_ratio=2.0)


def _hf_sam2_hiera() -> nn.Module:
    import transformers

    return transformers.Sam2HieraDetModel(hf_sam2_hiera_config())


def _coatnet(kind: str) -> Callable[[], nn.Module]:
    """A tiny timm CoAtNet (``kind``: a ``maxxvit.model_cfgs`` name): conv stages, then transformer stages."""
    def build() -> nn.Module:
        import dataclasses

        from timm.models.maxxvit import MaxxVit, model_cfgs

        base = model_cfgs[kind]
        cfg = dataclasses.replace(base, embed_dim=(16, 16, 32, 32), depths=(1, 1, 2, 1), stem_width=(16, 16),
                                  transformer_cfg=dataclasses.replace(base.transformer_cfg, dim_head=8))
        return MaxxVit(cfg, img_size=64, num_classes=5)

    return build


def _caformer() -> nn.Module:
    """A tiny timm CAFormer: separable-conv stages, then attention stages (grids 16, 8, 4, 2 at 64 px)."""
    from timm.models.metaformer import Attention, LayerNorm2dNoBias, LayerNormNoBias, MetaFormer, SepConv

    return MetaFormer(depths=(1, 1, 2, 1), dims=(16, 32, 64, 96), token_mixers=[SepConv, SepConv, Attention, Attention],
                      norm_layers=[LayerNorm2dNoBias] * 2 + [LayerNormNoBias] * 2, num_classes=5)


def _mvitv2() -> nn.Module:
    from timm.models.mvitv2 import MultiScaleVit, MultiScaleVitCfg

    return MultiScaleVit(MultiScaleVitCfg(depths=(1, 2), embed_dim=16, num_heads=1), img_size=64, num_classes=5)


def _zoo(name: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from vitexplain import zoo

        return zoo.load(name)

    return build


def _torch_decoder_captioner() -> nn.Module:
    from timm.models.vision_transformer import VisionTransformer

    from vitexplain.adapters.captioning import TransformerDecoderCaptioner

    encoder = VisionTransformer(**{**_VIT, "num_classes": 0})
    return TransformerDecoderCaptioner(encoder, vocab_size=20, dim=32, depth=2, heads=2, max_len=8)


def _vision_encoder_decoder() -> nn.Module:
    import transformers

    encoder = transformers.ViTConfig(**_HF)
    decoder = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=40, n_positions=32, bos_token_id=1, eos_token_id=2, add_cross_attention=True, is_decoder=True)
    config = transformers.VisionEncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder)
    config.decoder_start_token_id, config.pad_token_id = 1, 2
    return transformers.VisionEncoderDecoderModel(config)


def _vision_encoder_trocr() -> nn.Module:
    import transformers

    encoder = transformers.ViTConfig(**_HF)
    decoder = transformers.TrOCRConfig(d_model=32, decoder_layers=2, decoder_attention_heads=2, decoder_ffn_dim=64, vocab_size=40,
                                       max_position_embeddings=32, bos_token_id=0, pad_token_id=1, eos_token_id=2,
                                       decoder_start_token_id=2)
    config = transformers.VisionEncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder)
    config.decoder_start_token_id, config.pad_token_id = 2, 1
    model = transformers.VisionEncoderDecoderModel(config)
    with torch.no_grad():  # a random TrOCR says its end token first (an empty caption): its logit row is zeroed
        model.decoder.output_projection.weight[2] = 0.0
    return model


def _blip() -> nn.Module:
    import transformers

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8)
    text = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, vocab_size=40,
        encoder_hidden_size=32, max_position_embeddings=32, bos_token_id=1, sep_token_id=2, pad_token_id=0,
    )
    config = transformers.BlipConfig(vision_config=vision, text_config=text)
    return transformers.BlipForConditionalGeneration(config)


def _git() -> nn.Module:
    import transformers

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8)
    config = transformers.GitConfig(
        vision_config=vision, vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    return transformers.GitForCausalLM(config)


_SWIN = dict(img_size=32, patch_size=4, window_size=4, embed_dim=16, depths=(2, 2), num_heads=(2, 4), num_classes=5)
_SWIN_TEST = "tests/test_swin.py"


def _torchvision_swin(v2: bool) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from torchvision.models import swin_transformer as tv_swin

        extra = dict(block=tv_swin.SwinTransformerBlockV2, downsample_layer=tv_swin.PatchMergingV2) if v2 else {}
        return tv_swin.SwinTransformer(patch_size=[4, 4], embed_dim=16, depths=[2, 2], num_heads=[2, 4],
                                       window_size=[4, 4], num_classes=5, **extra)

    return build


def _hf_swin(config: str, model: str, **kwargs: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import transformers

        cfg = getattr(transformers, config)(image_size=32, patch_size=4, window_size=4, embed_dim=16,
                                            depths=[2, 2], num_heads=[2, 4], **kwargs)
        return getattr(transformers, model)(cfg)

    return build


def _vlm(name: str) -> Callable[[], Any]:
    def build() -> Any:
        import vlm_helpers

        return vlm_helpers.BUILDERS[name]()

    return build


def _encdec(name: str) -> Callable[[], Any]:
    def build() -> Any:
        import encdec_helpers

        return encdec_helpers.BUILDERS[name]()

    return build


_VLM_TEST = "tests/test_vlm.py"
_LRP_TEST = ", tests/test_vlm_lrp.py (attnlrp, cp_lrp)"
_ENCDEC_TEST = "tests/test_vlm_encdec.py"
_HF_TEST = "tests/test_families_hf.py::test_hf_family_matches_eager_oracle"
_HIER_TEST = "tests/test_hier.py"
_POOL_TEST = "tests/test_hier_pooling.py"
_HF_MORE_TEST = "tests/test_hier_hf_more.py"
_LEGRAD_TEST = "tests/test_hier_legrad.py"  # legrad on the last stage (dense float64 oracle)
_LEGRAD_MORE_TEST = "tests/test_hier_legrad_more.py"  # legrad, smooth and integrated CDAM: SAM 2 / 3, CAFormer, TinyViT
_RERUN_TEST = "tests/test_hier_cdam_rerun.py"  # smooth / integrated CDAM against their definitions
_TIMM_TEST = "tests/test_families_timm.py"


#: Hierarchical rows whose LRP maps tests/test_hier_lrp.py checks against its float64 hand-rule oracle; the other
#: covered hierarchical rows are checked there by CP-LRP's conservation without biases; none is refused.
_HIER_LRP_ORACLE = ("timm PVTv2", "timm Hiera (SAM 2's encoder family)", "timm SAM ViT (samvit: windowed + global, conv neck)",
                    "timm MaxViT", "timm CAFormer (separable-conv stages, then attention)")
_HIER_LRP_REFUSED: tuple[str, ...] = ()


def _with_hier_lrp(table: list[Row]) -> list[Row]:
    """The hierarchical rows' oracle field with the LRP test that checks them (attnlrp, cp_lrp)."""
    def one(row: Row) -> Row:
        if row.group != "hierarchical" or row.name in _HIER_LRP_REFUSED:
            return row
        how = "float64 oracle" if row.name in _HIER_LRP_ORACLE else "cp_lrp conservation"
        return replace(row, oracle=f"{row.oracle}, tests/test_hier_lrp.py (attnlrp, cp_lrp: {how})")
    return [one(row) for row in table]


def rows() -> list[Row]:
    """Every family of the support matrix, in the matrix's order."""
    s32, s64 = (32, 32), (64, 64)
    return _with_hier_lrp([
        Row("timm ViT (class token)", "ViT", _timm_vit(), s32, "tests/test_methods.py"),
        Row("timm ViT + register tokens", "ViT", _timm_vit(reg_tokens=4), s32, "tests/test_methods.py"),
        Row("timm ViT, average pooling", "ViT", _timm_vit(class_token=False, global_pool="avg"), s32, "tests/test_readout.py, tests/test_methods.py"),
        Row("timm ViT, attention pooling (global_pool='map', SigLIP)", "ViT", _timm_vit(class_token=False, global_pool="map"), s32,
            "tests/test_pool_readout.py"),
        Row("timm ViT, headless (num_classes=0)", "ViT", _timm_vit(num_classes=0), s32, "tests/test_families_hf.py::test_timm_headless_backbone_embedding_and_similarity", "norm"),
        Row("timm DeiT distilled", "ViT", _timm_class("deit", "VisionTransformerDistilled", **_VIT), s32, "tests/test_methods.py"),
        Row("timm EVA (rope)", "ViT", _timm_class("eva", "Eva", img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5, use_rot_pos_emb=True), s32, "tests/test_methods.py"),
        Row("timm BEiT", "ViT", _timm_class("beit", "Beit", img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5), s32, "tests/test_methods.py"),
        Row("timm ViT rel-pos (vit_relpos)", "ViT", _timm_class("vision_transformer_relpos", "VisionTransformerRelPos", **_VIT), s32, "tests/test_readout.py (avg-pool readout)"),
        Row("timm NaFlexViT (SigLIP 2 NaFlex / RADIO backbone, on image tensors; registers)", "ViT", lambda: _timm("naflexvit_base_patch16_gap", patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5), s32, "tests/test_vit_variants.py"),
        Row("timm CaiT", "ViT", _timm_class("cait", "Cait", img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, depth_token_only=2, num_classes=5), s32, _TIMM_TEST),
        Row("timm XCiT", "ViT", _timm_class("xcit", "Xcit", img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, cls_attn_layers=2, num_classes=5), s32, _TIMM_TEST),
        Row("timm ConViT", "ViT", _timm_class("convit", "ConVit", img_size=32, patch_size=8, embed_dim=16, depth=3, num_heads=2, local_up_to_layer=2, num_classes=5), s32, _TIMM_TEST),
        Row("torchvision VisionTransformer", "ViT", _torchvision_vit, s32, "tests/test_methods.py::test_torchvision_vit_methods_match_timm_style_oracle"),
        Row("zoo shapes-vit", "ViT", _zoo("shapes-vit"), s64, "tests/test_localization.py"),
        Row("HF ViT classifier", "Hugging Face", _hf("ViTConfig", "ViTForImageClassification", num_labels=5), s32, "tests/test_methods_hf.py"),
        Row("HF DeiT classifier", "Hugging Face", _hf("DeiTConfig", "DeiTForImageClassification", num_labels=5), s32, "tests/test_methods_hf.py"),
        Row("HF DeiT with teacher", "Hugging Face", _hf("DeiTConfig", "DeiTForImageClassificationWithTeacher", num_labels=5), s32, _HF_TEST),
        Row("HF DINOv2 classifier", "Hugging Face", _hf("Dinov2Config", "Dinov2ForImageClassification", num_labels=5), s32, _HF_TEST),
        Row("HF DINOv2 + registers", "Hugging Face", _hf("Dinov2WithRegistersConfig", "Dinov2WithRegistersForImageClassification", num_labels=5, num_register_tokens=2), s32, _HF_TEST),
        Row("HF BEiT classifier", "Hugging Face", _hf("BeitConfig", "BeitForImageClassification", num_labels=5), s32, _HF_TEST),
        Row("HF ViT-MSN classifier", "Hugging Face", _hf("ViTMSNConfig", "ViTMSNForImageClassification", num_labels=5), s32, _HF_TEST),
        Row("HF I-JEPA classifier (no class token)", "Hugging Face", _hf("IJepaConfig", "IJepaForImageClassification", num_labels=5), s32, _HF_TEST),
        Row("HF ViTModel (headless)", "Hugging Face", _hf("ViTConfig", "ViTModel"), s32, _HF_TEST, "norm"),
        Row("HF Dinov2Model (headless)", "Hugging Face", _hf("Dinov2Config", "Dinov2Model"), s32, _HF_TEST, "norm"),
        Row("HF DINOv3ViTModel (headless, RoPE, registers)", "Hugging Face", _hf("DINOv3ViTConfig", "DINOv3ViTModel", num_register_tokens=4), s32, _HF_TEST, "norm"),
        Row("HF MetaClip2VisionModel (headless)", "Hugging Face", _hf("MetaClip2VisionConfig", "MetaClip2VisionModel"), s32, _HF_TEST, "norm"),
        Row("HF Aimv2VisionModel (headless, attention pooling)", "Hugging Face", _hf("Aimv2VisionConfig", "Aimv2VisionModel"), s32,
            _HF_TEST + ", tests/test_pool_readout.py", "norm"),
        Row("HF CLIPVisionModel (headless)", "Hugging Face", _hf("CLIPVisionConfig", "CLIPVisionModel"), s32, _HF_TEST, "norm"),
        Row("HF SiglipVisionModel (headless, attention pooling)", "Hugging Face", _hf("SiglipVisionConfig", "SiglipVisionModel"), s32,
            _HF_TEST + ", tests/test_pool_readout.py", "norm"),
        Row("OpenCLIP ViT image tower", "ViT", _open_clip_tower, s32, "tests/test_openclip.py", "norm"),
        Row("timm ResNet", "CNN", lambda: _timm("resnet10t", num_classes=5), s32, "tests/test_cnn.py"),
        Row("timm ResNet + CBAM", "CNN", lambda: _timm("resnet10t", num_classes=5, block_args=dict(attn_layer="cbam")), s32, "tests/test_cnn.py"),
        Row("torchvision MobileNetV3 (SE)", "CNN", _torchvision_mobilenet, s32, "tests/test_cnn.py"),
        Row("HF ResNet classifier", "CNN", _hf_cnn("ResNetConfig", "ResNetForImageClassification", embedding_size=16, hidden_sizes=[16, 32, 48, 64], depths=[1, 1, 1, 1], num_labels=5), s64, "tests/test_cnn_hf.py"),
        Row("HF ConvNeXt classifier", "CNN", _hf_cnn("ConvNextConfig", "ConvNextForImageClassification", hidden_sizes=[16, 32, 48, 64], depths=[1, 1, 1, 1], num_labels=5), s64, "tests/test_cnn_hf.py"),
        Row("zoo shapes-cnn", "CNN", _zoo("shapes-cnn"), s64, "tests/test_cnn.py"),
        Row("torchvision ResNet-18 behind a normalisation layer (Sequential)", "CNN", _torchvision_resnet(wrapped=True), s32, "tests/test_cnn_fuzz.py"),
        Row("torchvision ResNet-18, fc = Identity (headless)", "CNN", _torchvision_resnet(headless=True), s32, "tests/test_cnn_fuzz.py", "norm"),
        Row("timm BotNet (self-attention blocks, one input size)", "hybrid", lambda: _timm("botnet26t_256", img_size=64, num_classes=5), s64, "tests/test_cnn_fuzz.py"),
        Row("timm HaloNet (halo attention in blocks: not recorded)", "hybrid", _halonet, s64, "tests/test_cnn_fuzz.py"),
        Row("timm ResNeSt (split attention)", "hybrid", lambda: _timm("resnest14d", num_classes=5), s64, "tests/test_cnn_fuzz.py"),
        Row("timm EfficientFormerV2", "hybrid", _timm_class("efficientformer_v2", "EfficientFormerV2", depths=(1, 1, 2, 2), embed_dims=(16, 24, 32, 48), img_size=64, num_vit=2, num_classes=5), s64, "tests/test_hybrids.py"),
        Row("timm EfficientViT (MIT: ReLU linear attention)", "hybrid", lambda: _timm("efficientvit_b0", num_classes=5), s64, "tests/test_hybrids.py"),
        Row("timm EfficientViT (MSRA: cascaded group attention)", "hybrid", lambda: _timm("efficientvit_m0", img_size=128, num_classes=5), (128, 128), "tests/test_hybrids.py"),
        Row("timm SwiftFormer (additive attention)", "hybrid", lambda: _timm("swiftformer_xs", num_classes=5), s64, "tests/test_hybrids.py"),
        Row("timm DaViT (window + channel attention)", "hybrid", lambda: _timm("davit_tiny", embed_dims=(16, 32, 32, 64), depths=(1, 1, 1, 1), num_heads=(1, 2, 2, 4), window_size=2, num_classes=5), s64, "tests/test_hybrids.py"),
        Row("timm CSATv2 (DCT stem, attention in its last stages)", "hybrid", _timm_class("csatv2", "CSATv2", dims=(32, 32, 48, 64), depths=(1, 1, 1, 1), transformer_depths=(0, 0, 1, 1), num_classes=5), (128, 128), "tests/test_hybrids.py"),
        Row("timm PVTv2", "hierarchical", lambda: _timm("pvt_v2_b0", embed_dims=(16, 32, 48, 64), depths=(1, 1, 1, 1), num_heads=(1, 2, 2, 4), num_classes=5), s64, f"{_HIER_TEST}, {_LEGRAD_TEST}, {_RERUN_TEST}"),
        Row("timm Twins (PCPVT)", "hierarchical", lambda: _timm("twins_pcpvt_small", img_size=64, embed_dims=(16, 32, 48, 64), depths=(1, 1, 1, 1), num_heads=(1, 2, 2, 4), num_classes=5), s64, f"{_HIER_TEST}, {_LEGRAD_TEST}, {_RERUN_TEST}"),
        Row("timm Twins (SVT)", "hierarchical", lambda: _timm("twins_svt_small", img_size=64, embed_dims=(16, 32, 48, 64), depths=(1, 1, 1, 1), num_heads=(1, 2, 2, 4), wss=(4, 4, 4, 4), num_classes=5), s64, f"{_HIER_TEST}, {_LEGRAD_TEST}, {_RERUN_TEST}"),
        Row("timm SAM ViT (samvit: windowed + global, conv neck)", "hierarchical", lambda: _timm("samvit_base_patch16", img_size=64, depth=3, embed_dim=32, num_heads=2, global_attn_indexes=(1,), window_size=3, neck_chans=16, num_classes=5), s64, f"{_HIER_TEST}, {_LEGRAD_TEST}, {_RERUN_TEST}"),
        Row("timm SAM ViT classifier (samvit_base_patch16_224: no conv neck)", "hierarchical", lambda: _timm("samvit_base_patch16_224", img_size=64, depth=2, embed_dim=32, num_heads=2, global_attn_indexes=(1,), window_size=3, num_classes=5), s64, f"tests/test_hier_fuzz.py, {_LEGRAD_TEST}, {_RERUN_TEST}"),
        Row("timm MaxViT", "hierarchical", _maxvit, s64, f"{_POOL_TEST}, {_LEGRAD_TEST}, {_RERUN_TEST}"),
        Row("timm CoAtNet (conv stages, then global attention)", "hierarchical", _coatnet("coatnet_nano_rw"), s64,
            f"tests/test_hier_coatnet.py, {_LEGRAD_TEST}, {_RERUN_TEST}"),
        Row("timm CoAtNeXt (ConvNeXt stages, then global attention)", "hierarchical", _coatnet("coatnext_nano_rw"), s64,
            "tests/test_hier_coatnet.py"),
        Row("timm CAFormer (separable-conv stages, then attention)", "hierarchical", _caformer, s64,
            f"tests/test_hier_caformer.py, {_LEGRAD_MORE_TEST}"),
        Row("timm TinyViT (MBConv stage, then padded window attention)", "hierarchical", lambda: _timm("tiny_vit_5m_224", embed_dims=(16, 32, 48, 64), depths=(1, 1, 1, 1), num_heads=(1, 2, 2, 4), window_sizes=(3, 3, 3, 3), num_classes=5), s64, f"tests/test_hier_tinyvit.py, {_LEGRAD_MORE_TEST}"),
        Row("timm MViTv2", "hierarchical", _mvitv2, s64, f"{_POOL_TEST}, {_LEGRAD_TEST}, {_RERUN_TEST}"),
        Row("timm PiT", "hierarchical", _timm_class("pit", "PoolingVisionTransformer", img_size=64, patch_size=8, stride=4, base_dims=(8, 8, 8), depth=(1, 1, 1), heads=(2, 2, 2), mlp_ratio=2, num_classes=5), s64, f"{_POOL_TEST}, {_LEGRAD_TEST}, {_RERUN_TEST}"),
        # raw reads the first call: the random model's last-stage tokens are identical, its attention uniform
        Row("timm LeViT", "hierarchical", _levit, (128, 128), f"{_POOL_TEST}, {_LEGRAD_TEST}, {_RERUN_TEST}", options={"raw": {"layer": 0}}),
        Row("timm LeViT, conv mode (levit_conv_*)", "hierarchical", _levit_conv, (128, 128),
            f"{_POOL_TEST}, tests/test_hier_levit_conv.py, tests/test_hier_legrad.py, {_RERUN_TEST}", options={"raw": {"layer": 0}}),
        Row("torchvision MaxViT", "hierarchical", _torchvision_maxvit, s64, f"tests/test_hier_more.py, {_LEGRAD_TEST}"),
        Row("timm Hiera (SAM 2's encoder family)", "hierarchical", _timm_class("hiera", "Hiera", img_size=64, embed_dim=16, num_heads=1, stages=(1, 2, 2, 1), mask_unit_size=(4, 4), q_pool=2, num_classes=5), s64, f"tests/test_hier_more.py, {_LEGRAD_TEST}, {_RERUN_TEST}"),
        Row("timm HieraDet (sam2_hiera: SAM 2's image encoder, windows on the grid)", "hierarchical", _timm_class("hieradet_sam2", "HieraDet", embed_dim=16, num_heads=1, stages=(1, 2, 3), q_pool=2, window_spec=(4, 2, 3), global_att_blocks=(5,), global_pos_size=(4, 4), num_classes=5), s64, f"tests/test_hier_sam2_timm.py, {_LEGRAD_MORE_TEST}"),
        Row("timm CrossViT (two branches)", "hierarchical", _timm_class("crossvit", "CrossVit", img_size=48, img_scale=(1.0, 32 / 48), patch_size=(8, 16), embed_dim=(16, 32), depth=((1, 2, 0), (1, 1, 0)), num_heads=(2, 2), mlp_ratio=(2, 2, 1), num_classes=5), (48, 48), f"tests/test_hier_more.py, {_LEGRAD_TEST}"),
        Row("HF PVT v1 classifier (class token on the last stage)", "hierarchical", _hf_cnn("PvtConfig", "PvtForImageClassification", image_size=64, hidden_sizes=[16, 32, 48, 64], depths=[1, 1, 1, 1], num_attention_heads=[1, 2, 2, 4], num_labels=5), s64, f"tests/test_hier_pvt.py, {_LEGRAD_TEST}, {_RERUN_TEST}"),
        Row("HF PvtV2 classifier", "hierarchical", _hf("PvtV2Config", "PvtV2ForImageClassification", image_size=64, hidden_sizes=[16, 32, 48, 64], depths=[1, 1, 1, 1], num_attention_heads=[1, 2, 2, 4], num_labels=5), s64, f"tests/test_hier_hf.py, {_LEGRAD_TEST}, {_RERUN_TEST}"),
        Row("HF Segformer classifier (MiT)", "hierarchical", _hf("SegformerConfig", "SegformerForImageClassification", image_size=64, hidden_sizes=[16, 32, 48, 64], depths=[1, 1, 1, 1], num_attention_heads=[1, 2, 2, 4], decoder_hidden_size=32, num_labels=5), s64, f"tests/test_hier_hf.py, {_LEGRAD_TEST}, {_RERUN_TEST}"),
        Row("HF Hiera classifier", "hierarchical", _hf("HieraConfig", "HieraForImageClassification", image_size=[64, 64], embed_dim=16, num_heads=[1, 2, 4], depths=[1, 2, 2], num_query_pool=2, masked_unit_size=[4, 4], masked_unit_attention=[True, True, False], patch_size=[7, 7], mlp_ratio=2.0, num_labels=5), s64, f"tests/test_hier_hiera.py, {_LEGRAD_TEST}, {_RERUN_TEST}"),
        Row("HF HieraModel (headless)", "hierarchical", _hf("HieraConfig", "HieraModel", image_size=[64, 64], embed_dim=16, num_heads=[1, 2, 4], depths=[1, 2, 2], num_query_pool=2, masked_unit_size=[4, 4], masked_unit_attention=[True, True, False], patch_size=[7, 7], mlp_ratio=2.0), s64, "tests/test_hier_hiera.py", "norm"),
        Row("HF SamVisionModel (headless)", "hierarchical", _hf("SamVisionConfig", "SamVisionModel", image_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=2, global_attn_indexes=[1], window_size=3, output_channels=16, mlp_dim=64), s64, f"tests/test_hier_hf.py, {_LEGRAD_TEST}, {_RERUN_TEST}", "norm"),
        Row("HF LeViT classifier", "hierarchical", _hf_levit("LevitForImageClassification"), (128, 128), _HF_MORE_TEST),
        Row("HF LeViT with teacher", "hierarchical", _hf_levit("LevitForImageClassificationWithTeacher"), (128, 128), f"{_HF_MORE_TEST}, {_LEGRAD_TEST}, {_RERUN_TEST}"),
        Row("HF LevitModel (headless)", "hierarchical", _hf_levit("LevitModel"), (128, 128), _HF_MORE_TEST, "norm"),
        Row("HF Sam3ViTModel (SAM 3's image encoder backbone, headless)", "hierarchical", _hf_cnn("Sam3ViTConfig", "Sam3ViTModel", hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2, image_size=112, patch_size=14, window_size=3, global_attn_indexes=[1, 3], pretrain_image_size=56), (112, 112), f"tests/test_hier_sam3.py, {_LEGRAD_MORE_TEST}", "norm"),
        Row("HF Sam2HieraDetModel (SAM 2's image encoder backbone, headless)", "hierarchical", _hf_sam2_hiera, s64, f"{_HF_MORE_TEST}, {_LEGRAD_MORE_TEST}", "norm"),
        Row("timm TNT (outer tokens)", "hierarchical", lambda: _timm("tnt_s_patch16_224", img_size=64, depth=2, num_classes=5), s64, f"{_POOL_TEST}, {_LEGRAD_TEST}, {_RERUN_TEST}"),
        Row("timm Swin", "Swin", _timm_class("swin_transformer", "SwinTransformer", **_SWIN), s32, _SWIN_TEST),
        Row("timm SwinV2", "Swin", _timm_class("swin_transformer_v2", "SwinTransformerV2", **_SWIN), s32, _SWIN_TEST),
        Row("timm SwinV2-CR", "Swin", _timm_class("swin_transformer_v2_cr", "SwinTransformerV2Cr", **_SWIN), s32, _SWIN_TEST),
        Row("torchvision Swin (swin_t)", "Swin", _torchvision_swin(v2=False), s32, _SWIN_TEST),
        Row("torchvision SwinV2 (swin_v2_t)", "Swin", _torchvision_swin(v2=True), s32, _SWIN_TEST),
        Row("HF Swin classifier", "Swin", _hf_swin("SwinConfig", "SwinForImageClassification", num_labels=5), s32, _SWIN_TEST),
        Row("HF Swinv2 classifier", "Swin", _hf_swin("Swinv2Config", "Swinv2ForImageClassification", num_labels=5), s32, _SWIN_TEST),
        Row("HF SwinModel (headless)", "Swin", _hf_swin("SwinConfig", "SwinModel"), s32, _SWIN_TEST, "norm"),
        Row("HF DonutSwinModel (Donut's encoder, headless)", "Swin", _hf_swin("DonutSwinConfig", "DonutSwinModel"), s32, _SWIN_TEST,
            "norm"),
        Row("zoo shapes-captioner", "captioner", _zoo("shapes-captioner"), s64, "tests/test_captioning.py"),
        Row("zoo shapes-sat (Show, Attend and Tell: additive attention, LSTM)", "captioner", _zoo("shapes-sat"), s64,
               "tests/test_sat.py"),
        Row("nn.TransformerDecoder over timm ViT", "captioner", _torch_decoder_captioner, s32, "tests/test_captioning.py"),
        Row("HF VisionEncoderDecoder (ViT + GPT-2)", "captioner", _vision_encoder_decoder, s32, "tests/test_captioning.py"),
        Row("HF VisionEncoderDecoder (ViT + TrOCR: heads folded into the batch)", "captioner", _vision_encoder_trocr, s32,
            "tests/test_caption_fuzz.py"),
        Row("HF BLIP", "captioner", _blip, s32, "tests/test_captioning.py"),
        Row("HF GIT", "captioner", _git, s32, "tests/test_git.py"),
        Row("HF LLaVA", "VLM", _vlm("llava"), s32, _VLM_TEST + _LRP_TEST),
        Row("HF Mistral 3 (Pixtral tower, 2 x 2 merger, row breaks)", "VLM", _vlm("mistral3"), s32,
            "tests/test_vlm_mistral3.py" + _LRP_TEST),
        Row("HF LightOnOCR (Mistral 3's tower and merger, no row breaks)", "VLM", _vlm("lighton_ocr"), s32,
            "tests/test_vlm_mistral3.py" + _LRP_TEST),
        Row("HF InternVL (tiles + thumbnail, pixel shuffle)", "VLM", _vlm("internvl"), s32,
            "tests/test_vlm_internvl.py" + _LRP_TEST),
        Row("HF GLM-4.1V (Qwen2-VL geometry)", "VLM", _vlm("glm4v"), s32, "tests/test_vlm_glm4v.py"),
        Row("HF GLM-4.5V (experts in the LM)", "VLM", _vlm("glm4v_moe"), s32, "tests/test_vlm_glm4v.py"),
        Row("HF GLM-4.6V", "VLM", _vlm("glm46v"), s32, "tests/test_vlm_glm4v.py"),
        Row("HF GLM-OCR (GLM-4.6V's processor)", "VLM", _vlm("glm_ocr"), s32, "tests/test_vlm_glm4v.py"),
        Row("HF Qwen3-VL-MoE", "VLM", _vlm("qwen3_vl_moe"), s32, "tests/test_vlm_qwen.py"),
        Row("HF Qwen3.5 (hybrid LM: linear attention + attention layers)", "VLM", _vlm("qwen3_5"), s32,
            "tests/test_vlm_qwen35.py"),
        Row("HF Qwen3.5-MoE", "VLM", _vlm("qwen3_5_moe"), s32, "tests/test_vlm_qwen35.py"),
        Row("HF Aya Vision (tiles + global image, pixel shuffle)", "VLM", _vlm("aya_vision"), s32, "tests/test_vlm_internvl.py"),
        Row("HF Pixtral-12B layout (LLaVA with a Pixtral tower)", "VLM", _vlm("pixtral"), s32,
            "tests/test_vlm_mistral3.py" + _LRP_TEST),
        Row("HF Command A Vision (Cohere2Vision: tiles + global image)", "VLM", _vlm("cohere2_vision"), s32, "tests/test_vlm_internvl.py"),
        Row("HF Qianfan-OCR (InternVL's tiles, an <image> placeholder)", "VLM", _vlm("qianfan_ocr"), s32,
            "tests/test_vlm_internvl.py" + _LRP_TEST),
        Row("HF ViP-LLaVA (projector over several tower layers)", "VLM", _vlm("vipllava"), s32, "tests/test_vlm_llava.py" + _LRP_TEST),
        Row("HF PaliGemma", "VLM", _vlm("paligemma"), s32, _VLM_TEST + _LRP_TEST),
        Row("HF PaliGemma 2 (Gemma 2 LM: eager attention, its only one)", "VLM", _vlm("paligemma2"), s32, _VLM_TEST),
        Row("HF Gemma 3", "VLM", _vlm("gemma3"), s32, _VLM_TEST + _LRP_TEST),
        Row("HF Gemma 4 (native aspect ratio, pooled patches)", "VLM", _vlm("gemma4"), s32, "tests/test_vlm_gemma4.py"),
        Row("HF Gemma 4 with experts and shared KV layers", "VLM", _vlm("gemma4_moe"), s32, "tests/test_vlm_gemma4.py"),
        Row("HF Gemma 3 with pan-and-scan crops (processor_kwargs)", "VLM", _vlm("gemma3_pan_and_scan"), s32,
            "tests/test_vlm_gemma.py" + _LRP_TEST),
        Row("HF Qwen2-VL", "VLM", _vlm("qwen2_vl"), s32, _VLM_TEST + _LRP_TEST),
        Row("HF Qwen2.5-VL", "VLM", _vlm("qwen2_5_vl"), s32, _VLM_TEST + _LRP_TEST),
        Row("HF Qwen3-VL", "VLM", _vlm("qwen3_vl"), s32, _VLM_TEST + _LRP_TEST),
        Row("HF EXAONE 4.5 (Qwen2.5-VL's tower, 1-D positions)", "VLM", _vlm("exaone4_5"), s32, "tests/test_vlm_qwen.py"),
        Row("HF Idefics3", "VLM", _vlm("idefics3"), s32, _VLM_TEST + _LRP_TEST),
        Row("HF LFM2-VL (tiles + thumbnail, pixel unshuffle; LM with convolution layers)", "VLM", _vlm("lfm2_vl"), s32,
            "tests/test_vlm_lfm2.py"),
        Row("HF SmolVLM", "VLM", _vlm("smolvlm"), s32, _VLM_TEST + _LRP_TEST),
        Row("HF Janus / Janus-Pro (letterboxed square)", "VLM", _vlm("janus"), s32, "tests/test_vlm_janus.py"),
        Row("HF DeepSeek-VL (letterboxed square, SigLIP tower)", "VLM", _vlm("deepseek_vl"), s32, "tests/test_vlm_janus.py"),
        Row("HF PerceptionLM (thumbnail + tiles, pooled patches, timm tower)", "VLM", _vlm("perception_lm"), s32,
            "tests/test_vlm_perception_lm.py"),
        Row("HF Molmo2 (low-resolution view + overlapping crops, attention-pooled patches)", "VLM", _vlm("molmo2"), s32,
            "tests/test_vlm_molmo2.py"),
        Row("HF MiniCPM-V 4.6 (source + slices, patches merged 4 x 4; hybrid LM)", "VLM", _vlm("minicpmv4_6"), s32,
            "tests/test_vlm_minicpmv.py"),
        Row("HF MiniCPM-V 4.7 (4.6 with canvas M-RoPE positions)", "VLM", _vlm("minicpmv4_7"), s32,
            "tests/test_vlm_minicpmv.py"),
        Row("HF Fuyu (patches projected straight into the LM)", "VLM", _vlm("fuyu"), s32, "tests/test_vlm_fuyu.py"),
        Row("HF LLaVA-NeXT", "VLM", _vlm("llava_next"), s32, _VLM_TEST + _LRP_TEST),
        Row("HF LLaVA-NeXT-Video (images: LLaVA-NeXT's tiles)", "VLM", _vlm("llava_next_video"), s32,
            "tests/test_vlm_llava.py" + _LRP_TEST),
        Row("HF Video-LLaVA (images: LLaVA-1.5's patches, its image tower)", "VLM", _vlm("video_llava"), s32,
            "tests/test_vlm_llava.py" + _LRP_TEST),
        Row("HF LLaVA-OneVision", "VLM", _vlm("onevision"), s32, _VLM_TEST + _LRP_TEST),
        Row("HF mllama (Llama 3.2 Vision: cross-attention layers)", "VLM", _vlm("mllama"), s32,
            "tests/test_vlm_mllama.py" + _LRP_TEST),
        Row("HF BLIP-2", "VLM", _vlm("blip2"), s32, _VLM_TEST),
        Row("HF InstructBLIP", "VLM", _vlm("instructblip"), s32, _VLM_TEST),
        Row("HF Kosmos-2", "VLM", _vlm("kosmos2"), s32, _VLM_TEST),
        Row("HF Idefics2 (perceiver resampler per piece: quadrants + whole image)", "VLM", _vlm("idefics2"), s32,
            "tests/test_vlm_idefics2.py"),
        Row("HF Florence-2", "VLM", _encdec("florence2"), s32, _ENCDEC_TEST),
        Row("HF Pix2Struct", "VLM", _encdec("pix2struct"), s32, _ENCDEC_TEST),
    ])


# -- running -----------------------------------------------------------------------------------
def reinit_heads(model: nn.Module, seed: int = 0) -> None:
    """Give (near-)zero-initialised heads and residual-branch norms random values (in place).

    torchvision's ViT head and timm's EVA/BEiT heads start at (or within 1e-3 of) zero, and
    timm ResNets zero the last norm of each residual branch (``zero_init_last``; LeViT its
    attention projections' BatchNorm1d): every
    gradient or gate map of such a model is constant (or 1e-8 small). Linear layers whose
    weights are all below 1e-3 get ``N(0, 1 / fan_in)``; norms with zero weight get 1.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            weight = getattr(module, "weight", None)
            if not isinstance(weight, torch.Tensor) or weight.numel() == 0:
                continue
            if isinstance(module, nn.Linear) and bool(weight.abs().max() < 1e-3):
                weight.copy_(torch.randn(weight.shape, generator=generator) / math.sqrt(weight.shape[1]))
            elif isinstance(module, (nn.BatchNorm1d, nn.BatchNorm2d, nn.LayerNorm, nn.GroupNorm)) and not bool(weight.abs().max() > 0):
                weight.fill_(1.0)


def _check(maps: torch.Tensor, batch: int) -> Optional[str]:
    if maps.dim() not in (3, 4) or maps.shape[0] != batch:
        return f"maps of shape {tuple(maps.shape)} for a batch of {batch}"
    if not bool(torch.isfinite(maps).all()):
        return "maps are not finite"
    return None


@dataclass
class Sweep:
    """One row's sweep: the model's family (as recognised) and what each method did."""

    row: Row
    family: Family
    outcomes: list[Outcome]
    default: Outcome = field(default_factory=lambda: Outcome("(default)", "n/a"))


def run(row: Row, batch: int = 4, seed: int = 0) -> Sweep:
    """Every method of the model's family on the row's tiny build, as its plan decides.

    Methods the plan refuses come out ``"n/a"`` with the plan's reason; the methods it lists
    come out ``"ok"`` (a finite map per image: (B, h, w), or (B, T, h, w) for captioners) or
    ``"refused"`` (a VitexplainError at run time). Any other exception propagates, and so does
    a listed method whose maps are not finite or not one per image (AssertionError).
    """
    torch.manual_seed(seed)
    built = row.build()
    model, processor = built if isinstance(built, tuple) else (built, None)
    model = model.eval()
    reinit_heads(model, seed)
    ex = vx.Explainer(model, processor=processor)
    available, refused = applicable(ex.adapter)
    x: Any = torch.randn(batch, 3, *row.size, generator=torch.Generator().manual_seed(seed))
    prompt = {}
    if ex.family.name == "vlm":  # vision-language models take images and a prompt
        x = list((x.clamp(-2, 2) * 60 + 128).to(torch.uint8).permute(0, 2, 3, 1).numpy())
        prompt = {"prompt": "what is"}
    target = vx.targets.norm() if row.target == "norm" else None
    outcomes = []
    if ex.adapter.notes.get("family"):  # why a family has none of another family's methods
        outcomes.append(Outcome("ViT methods", "n/a", ex.adapter.notes["family"]))
    for name, why in refused.items():
        outcomes.append(Outcome(name, "n/a", why))
    for name in available:
        options = {**CHEAP.get(name, {}), **row.options.get(name, {})}
        try:
            if ex.family.entry == "explain_caption":
                e = ex.explain_caption(x, method=name, max_len=3, **prompt, **options)
            else:
                e = ex.explain(x, method=name, target=target, **options)
        except VitexplainError as err:
            outcomes.append(Outcome(name, "refused", str(err)))
            continue
        problem = _check(e.maps, batch)
        assert problem is None, f"{row.name}: {name}: {problem}"
        zero = "zero " if not bool(e.maps.any()) else ""
        outcomes.append(Outcome(name, "ok", f"{zero}{tuple(e.maps.shape)}", float(e.maps.float().std())))
    order = {spec.name: i for i, spec in enumerate(vx.methods.specs(ex.family))}
    outcomes.sort(key=lambda o: order.get(o.method, -1))
    return Sweep(row, ex.family, outcomes, _default(ex, x, target, batch, prompt))


def _default(ex: Any, x: Any, target: Any, batch: int, prompt: dict[str, Any]) -> Outcome:
    """The explanation asked for with no method: the family's default (whatever applies)."""
    try:
        if ex.family.entry == "explain_caption":
            e = ex.explain_caption(x, max_len=3, **prompt)
        else:
            e = ex.explain(x, target=target)
    except VitexplainError as err:
        return Outcome("(default)", "refused", str(err))
    problem = _check(e.maps, batch)
    return Outcome(e.method, "ok" if problem is None else "broken", problem or f"{tuple(e.maps.shape)}")


# -- tables ------------------------------------------------------------------------------------
#: The matrix's columns: (heading, methods), in the registry's order.
GROUPS: list[tuple[str, tuple[str, ...]]] = [
    ("attention", ("raw", "rollout")),
    ("gradient x attention", ("grad_rollout", "generic", "attn_gradcam")),
    ("tokens", ("cdam", "gradcam")),
    ("re-run (checked)", ("cdam_smooth", "cdam_integrated", "legrad")),
    ("captum", ("integrated_gradients", "occlusion", "smoothgrad")),
    ("CNN stage", ("gradcam", "gradcam++", "layercam")),
    ("gates", ("spatial", "channel")),
    ("caption / VLM (per word)", ("cross", "cross_grad", "cross_generic")),
    ("LRP", ("attnlrp", "cp_lrp")),
]


def _cell(group: tuple[str, ...], family: Family, outcomes: dict[str, Outcome]) -> str:
    cnn_like = family is CNN
    relevant = [m for m in group if m in outcomes]
    if group == GROUPS[5][1] and not cnn_like or group == GROUPS[2][1] and cnn_like:
        relevant = []  # "gradcam" is a ViT method for ViTs, a CNN method for CNNs
    ok = [m for m in relevant if outcomes[m].status == "ok"]
    if not relevant or not ok:
        return "-"
    return "yes" if len(ok) == len(relevant) else ", ".join(ok)


def readme_table(results: list[Sweep]) -> str:
    """The support matrix's table (markdown) from :func:`run` results."""
    head = "| family | " + " | ".join(name for name, _ in GROUPS) + " |"
    lines = [head, "|" + "---|" * (len(GROUPS) + 1)]
    for sweep in results:
        by_name = {o.method: o for o in sweep.outcomes}
        cells = [_cell(methods, sweep.family, by_name) for _, methods in GROUPS]
        lines.append(f"| {sweep.row.name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def support_doc(results: list[Sweep]) -> str:
    """``docs/support.md``: per family, what runs, what does not and why, and its oracle test."""
    out = [
        "# Support matrix",
        "",
        "Generated by `python tools/support_matrix.py` from the table in `tests/support_table.py`; the",
        "sweep `tests/test_support_matrix.py` runs the same table (a tiny random-init build of each",
        "family, every method its plan lists: `vx.Explainer(model).methods()`) and fails when this file",
        "is out of date. A method the plan refuses raises `UnsupportedMethodError` with the reason below.",
        "",
        readme_table(results),
        "",
    ]
    for sweep in results:
        ok = [o.method for o in sweep.outcomes if o.status == "ok"]
        out += [f"## {sweep.row.name}", "", f"- runs: {', '.join(f'`{m}`' for m in ok) or 'nothing'}"]
        for o in sweep.outcomes:
            if o.status != "ok":
                reason = o.detail.split(". Methods that apply")[0]
                label = o.method if o.method == "ViT methods" else f"`{o.method}`"
                out.append(f"- {label} ({'refused at run time' if o.status == 'refused' else 'not listed'}): {reason}")
        out += [f"- checked against an oracle in `{sweep.row.oracle}`", ""]
    return "\n".join(out)
