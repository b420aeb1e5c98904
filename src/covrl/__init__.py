"""covrl: reinforcement learning for language models, measured from the sampler."""

__version__ = "0.1.0"
