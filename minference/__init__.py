"""minference: training-free dynamic sparse attention for long-context prefill.

Importing this package needs neither a GPU nor a compiler; Triton kernels compile on first use.
"""

from minference.config import PatternConfig, load_config
from minference.integration import patch, unpatch
from minference.patterns import AShape, BlockSparse, Dense, Pattern, VerticalSlash

__version__ = "0.1.0"

__all__ = [
    "AShape",
    "BlockSparse",
    "Dense",
    "Pattern",
    "PatternConfig",
    "VerticalSlash",
    "__version__",
    "load_config",
    "patch",
    "unpatch",
]
