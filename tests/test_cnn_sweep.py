"""CNNs and uses of the CNN family the other CNN tests do not cover (found by a sweep of timm, torchvision and
Hugging Face CNNs at random init: plans, every listed method, batches against their images one by one, non-square
and channels-last inputs, training mode, the model left as found):

- torchvision CNNs were given timm's default preprocessing (bicubic, 224 px, crop 0.875): torchvision's weights
  resize with bilinear interpolation, and Inception v3 was trained at 299 px (resize 342), so images passed as
  arrays or paths did not look like the ones the weights were trained on (adapters/tv_preprocess.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torchvision
from PIL import Image

import vitexplain as vx

# builder, keyword arguments (the 1000 ImageNet classes: the parameter count of torchvision's weights)
TV_PREPROCESS = {
    "inception_v3": dict(init_weights=False),  # resize 342, crop 299, bilinear
    "resnet18": {},  # resize 256, crop 224, bilinear
    "efficientnet_b0": {},  # resize 256, crop 224, bicubic
    "convnext_tiny": {},  # resize 236, crop 224, bilinear
}


@pytest.mark.parametrize("name", list(TV_PREPROCESS))
def test_torchvision_cnn_images_are_preprocessed_as_its_weights_transform_does(name):
    model = getattr(torchvision.models, name)(**TV_PREPROCESS[name]).eval()
    transform = torchvision.models.get_model_weights(name).DEFAULT.transforms()
    image = np.random.default_rng(3).integers(0, 255, (310, 420, 3), dtype=np.uint8)  # resampled: not square
    x = vx.Explainer(model).preprocess([image])[0]
    want = transform(Image.fromarray(image))[None]
    assert x.shape == want.shape, (x.shape, want.shape)
    torch.testing.assert_close(x, want, rtol=0, atol=1e-4)
