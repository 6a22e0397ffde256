"""Pooling models served beside the generator: embeddings, reward models and classifiers.

Prefill-only work: a batch of token lists goes through an encoder (bert.py) or an mlx-lm decoder
backbone, is pooled per sequence (heads.py) and, for sequence-classification models, scored by the
`score.weight` head (model.py). spec.py says what a model directory is without loading it (no MLX:
ingress and the tokenizer stage read it); load.py finds and loads models (the embedded
all-MiniLM-L6-v2 too). The engine process batches their requests in parallm/engine/pooling_queue.py,
which imports this package (never the other way: nothing here imports the engine).
"""
