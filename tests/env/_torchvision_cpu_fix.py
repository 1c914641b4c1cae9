"""Test-environment fix (never shipped): make the registry's torchvision importable beside CPU torch.

SGLang imports ``torchvision.transforms`` at import time, and the registry has no CPU build of
torchvision for our torch: its compiled ops fail to load (they need CUDA libraries), which torchvision
tolerates, but ``torchvision/_meta_registrations.py`` then registers fake kernels for ``torchvision::nms``
and ``torchvision::qnms`` without checking, and ``import torchvision`` fails with "operator
torchvision::nms does not exist" — breaking transformers model classes and vLLM in the same environment.

This module (loaded by a one-line ``.pth`` file that ``make venv`` installs) defines the two operator
schemas just before that module runs, and only when the compiled ops are missing. It imports nothing at
interpreter start; it acts when torchvision is first imported.
"""

import importlib.abc
import sys


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):  # noqa: ANN001, ANN201
        if name != "torchvision._meta_registrations":
            return None
        sys.meta_path.remove(self)
        import torch
        import torchvision.extension as ext

        if not ext._has_ops():
            for op in ("nms", "qnms"):
                try:
                    torch.library.define(
                        f"torchvision::{op}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"
                    )
                except RuntimeError:
                    pass
        return None


sys.meta_path.insert(0, _Finder())
