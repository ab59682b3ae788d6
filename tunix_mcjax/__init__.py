"""tunix_mcjax: multi-controller JAX runtime for GRPO post-training (LoCoJAX-CO/DA)."""

__version__ = "0.1.0"
