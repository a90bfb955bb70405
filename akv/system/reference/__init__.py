"""Reference implementations: the semantic oracle and the plain PyTorch formulas kernels are tested against."""
