import pytest

from .server import Server


@pytest.fixture(scope="session")
def server():
    """One real parallm-launch on the default model for the whole session."""
    with Server("--engine.max-num-seqs", "32") as srv:
        yield srv


@pytest.fixture(scope="session")
def openai_client(server):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)
