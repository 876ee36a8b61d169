"""d3d: asynchronous speculative decoding with standalone diffusion drafters."""
__version__ = "0.1.0"
