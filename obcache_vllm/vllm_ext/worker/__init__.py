"""The worker side: the model-runner mixin, the attention seam, one adapter per backend."""
