"""AttnLRP and CP-LRP for hierarchical and pooling transformers (family ``"hier"``).

The same functions as the ViT family's (:mod:`vitexplain.methods.lrp`): one forward and one backward
of the unchanged, fused model under :class:`~vitexplain.methods.lrp_rules.LRPRules`, relevance
``x * dscore/dx`` summed over the colour channels at pixel resolution (B, H, W), or summed per cell of
the finest token grid (``resolution="patches"``).

Nothing here is specific to one model: the token resampling of these models (patch merging, strided
or pooling convolutions, PVT's spatial-reduction convolution, Hiera's mask-unit max pooling, MViTv2's
pooling convolutions, windows and their reversal, padding and cropping) is made of torch calls the
rules leave as they are (docs/methods.md, "LRP through token resampling"): linear maps (reshape,
permute, index, pad, average pooling, convolution, BatchNorm in eval) keep their gradient, which
is LRP's epsilon rule (epsilon -> 0) for them, and max pooling keeps its gradient too, which routes
all relevance to the winner of each window (the winner-take-all rule for max pooling; Montavon et al.,
"Layer-wise relevance propagation: an overview", 2019, section 10.2.3 and Bach et al. 2015, PLoS ONE,
section 3.3). Whether a model's forward holds only calls the rules cover is decided at run time by
:func:`~vitexplain.methods.lrp_coverage.check_coverage`, which refuses the model with the call it
could not cover.
"""

from __future__ import annotations

from .families import HIER
from .lrp import _COMMON, _rules, attnlrp, cp_lrp
from .registry import register

__all__: list[str] = []

register("attnlrp", HIER, **_COMMON, forward_rules=_rules("attnlrp"),
         summary="AttnLRP through the token resampling (see the vit family); refused when a call is not covered",
         reference="Achtibat et al., AttnLRP, ICML 2024; docs/methods.md")(attnlrp)
register("cp_lrp", HIER, **_COMMON, forward_rules=_rules("cp"),
         summary="CP-LRP through the token resampling (see the vit family); refused when a call is not covered",
         reference="Ali et al., ICML 2022; docs/methods.md")(cp_lrp)
