"""Fixtures of the sampling tests."""

import pytest


@pytest.fixture(scope="module")
def tiny():
    """The same model and tokenizer as `model=tiny`, and an in-process sampler with the server's settings."""
    from rljax.sampling import InProcessSampler
    from rljax.sampling import server as server_lib

    model, tokenizer = server_lib.build_tiny(seed=0)
    return model, tokenizer, InProcessSampler(model, max_batch=8, top_logprobs=5)


@pytest.fixture(scope="session")
def served(tmp_path_factory):
    """The `rljax serve --config.model=tiny` the server tests share (one start per test process): admin token
    (from the environment), a weights root, the tokenizer exported at start-up, top_logprobs=5. Tests that
    change its weights put the initial ones (`build_tiny(seed=0)`) back."""
    from sampling_servers import ADMIN_TOKEN, Server

    root = tmp_path_factory.mktemp("weights_root")
    tokenizer_dir = tmp_path_factory.mktemp("served_tokenizer")
    server = Server("--config.top_logprobs=5", f"--config.weights_root={root}",
                    f"--config.tokenizer_dir={tokenizer_dir}", admin_token=ADMIN_TOKEN)
    try:
        server.ready()
        server.root, server.tokenizer_dir = root, tokenizer_dir
        yield server
    finally:
        server.stop()
