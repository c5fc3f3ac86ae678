"""Test-session setup. ``TRITON_INTERPRET`` must be set before triton's first import: without a
GPU every Triton kernel runs in the interpreter on CPU tensors."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
