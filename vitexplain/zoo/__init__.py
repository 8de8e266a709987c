"""Bundled zoo of tiny models trained on the synthetic shapes benchmark (offline).

``vx.zoo.names()`` lists them, ``vx.zoo.load(name)`` returns an eval-mode model with its
preprocessing and label names attached (``model.pretrained_cfg``), ``vx.zoo.info(name)`` describes
one (config, training time, held-out accuracy, size). Training scripts:
``python -m vitexplain.zoo.train NAME --out DIR`` (``shapes-vlm``:
``python -m vitexplain.zoo.train_vlm --out DIR``). ``shapes-vlm`` is a Hugging Face LLaVA (needs
transformers); ``vx.zoo.processor("shapes-vlm")`` (or ``model.vx_processor``) is its processor.
"""

from __future__ import annotations

from .hub import WEIGHTS_DIR, info, load, load_checkpoint, names, processor, save_checkpoint

__all__ = ["names", "load", "info", "processor", "load_checkpoint", "save_checkpoint", "WEIGHTS_DIR"]
