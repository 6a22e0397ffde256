import httpx
import pytest

from parallm.client import Client

from .server import Server


@pytest.fixture(scope="session")
def pooling_models(tmp_path_factory):
    """The session server's pooling models: the embedded all-MiniLM-L6-v2 and tiny random-weight decoders
    (tests/_pooling_helpers.py): a reward model, a 3-class classifier and a Matryoshka embedding model.
    {served name: (directory, mlx-lm model, score weight)}."""
    from tests._pooling_helpers import write_decoder

    root = tmp_path_factory.mktemp("pooling")
    return {"rm": write_decoder(root / "rm", "seqcls", seed=3),
            "clf": write_decoder(root / "clf", "seqcls", seed=4, labels=3),
            "emb": write_decoder(root / "emb", "embed", seed=5, extra={"matryoshka_dimensions": [16, 32]})}


@pytest.fixture(scope="session")
def server(tmp_path_factory, pooling_models):
    """One real parallm-launch on the default model for the whole session, with pooling models and a small
    policy beside it (the policy stage); it loads adapters by path from the tests' temporary directories."""
    from tests._policy_helpers import MLP_CATEGORICAL
    from parallm.policies import save_policy

    policy = save_policy(tmp_path_factory.mktemp("session-policy"), MLP_CATEGORICAL, seed=1)  # served beside the LM
    pooling = ["--pooling-model", "minilm=default"]
    for name, (path, _, _) in pooling_models.items():
        pooling += ["--pooling-model", f"{name}={path}"]
    with Server("--engine.max-num-seqs", "32", "--adapters.allowed-dirs", str(tmp_path_factory.getbasetemp()),
                "--policy-model", f"mlp={policy}", "--policies.lm", "true", *pooling) as srv:
        yield srv


@pytest.fixture(scope="session")
def openai_client(server):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def http(server):
    """An HTTP client of the session server."""
    with httpx.Client(base_url=server.url, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def raw(server):
    """A raw ZeroMQ client of the session server."""
    with Client(server.router, timeout=300) as c:
        yield c
