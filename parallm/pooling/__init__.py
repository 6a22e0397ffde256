"""Pooling models served beside the generator: embeddings, reward models and classifiers.

Prefill-only work: a batch of token lists goes through an encoder (bert.py) or an mlx-lm decoder
backbone, is pooled per sequence (heads.py) and, for sequence-classification models, scored by the
`score.weight` head (model.py). load.py finds and loads them (the embedded all-MiniLM-L6-v2 too).
"""

from .load import load_pooling_model, resolve_pooling_dir
from .model import TASKS, PoolingInfo, PoolingModel

__all__ = ["TASKS", "PoolingInfo", "PoolingModel", "load_pooling_model", "resolve_pooling_dir"]
