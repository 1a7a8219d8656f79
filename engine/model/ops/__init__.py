"""How a model's arithmetic runs: the ops objects (torch, the C++ CPU kernels, Triton) and
the attention backends they call."""
