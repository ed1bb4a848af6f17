"""`verst serve session --lora-path NAME[=DIR]`: the session server's engine client names an adapter, which
it loads into the engine first (NAME=DIR) or finds there (NAME); a name or directory the engine does not
serve is refused naming the option."""

import asyncio

import pytest

from tests.lora_adapters import make_adapter
from verst.cli.serve import session_adapter
from verst.engine.core import EngineConfig, EngineCore
from verst.engine.process import BackgroundServer
from verst.inference_client.client import EngineClient
from verst.models.loader import load_model, load_tokenizer

PROMPT = [5, 17, 33, 2, 90, 41]
GREEDY = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    server = BackgroundServer(EngineCore(load_model(tiny_model_dir), load_tokenizer(tiny_model_dir),
                                         EngineConfig(seed=0)), model_path=str(tiny_model_dir))
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_the_session_engine_client_names_the_adapter_it_loaded(engine, tiny_model_dir, tmp_path):
    make_adapter(tiny_model_dir, tmp_path / "adapter", seed=3)

    async def main():
        async with EngineClient(engine.url) as control:
            loaded = await session_adapter(control, f"math={tmp_path / 'adapter'}")
            again = await session_adapter(control, "math")
            errors = []
            for spec in ("code", f"bad={tmp_path / 'missing'}", "=x"):
                with pytest.raises(ValueError) as error:
                    await session_adapter(control, spec)
                errors.append(str(error.value))
            base = await control.generate(PROMPT, GREEDY, return_logprob=True)
        async with EngineClient(engine.url, lora_path=loaded) as session_client:  # as the session server builds it
            adapted = await session_client.generate(PROMPT, GREEDY, return_logprob=True)
        async with EngineClient(engine.url) as control:
            named = await control.generate(PROMPT, GREEDY, return_logprob=True, lora_path="math")
        return loaded, again, errors, base, adapted, named

    loaded, again, errors, base, adapted, named = asyncio.run(main())
    assert loaded == again == "math"
    assert "--lora-path 'code'" in errors[0] and "['math']" in errors[0]
    assert errors[1].startswith("--lora-path 'bad=") and "refused" in errors[1]
    assert "NAME=DIR" in errors[2]
    assert adapted.logprobs == named.logprobs and adapted.logprobs != base.logprobs
