"""crossfed: one LLM pre-training run pooled across several Slurm supercomputers."""

__version__ = "0.1.0"
