"""verst on a real pretrained model (SmolLM2-135M-Instruct: Llama with tied embeddings, its own 49k BPE
tokenizer and ChatML template): the engine serves it, the trainer trains it with logprobs equal to the
engine's, the session server records its exact token ids, and SFT exports a checkpoint transformers loads.
`slow`: each loads the 135M-parameter checkpoint (tests/real_model.py provides it)."""

import asyncio
import json
import math

import httpx
import openai
import pytest
import torch
import torch.distributed as dist

from tests.parity import as_items, assert_parity, rollout
from verst.config.schema import ModelConfig, TrainerConfig
from verst.engine.core import EngineConfig, EngineCore
from verst.engine.process import BackgroundServer, EngineProcess
from verst.inference_client.client import EngineClient
from verst.models.loader import chat_prompt_ids, load_model, load_model_and_tokenizer
from verst.session.http import SessionServer
from verst.session.manager import SessionManager
from verst.trainer import FSDP2Backend, sft_loss_fn
from verst.types import Sample

pytestmark = pytest.mark.slow
torch.set_num_threads(1)
QUESTIONS = ["What is 3 + 4?", "Name a colour of the sky."]
TEMPERATURE = 0.8


@pytest.fixture(scope="module")
def loaded(smollm2_dir):
    return load_model_and_tokenizer(smollm2_dir)


@pytest.fixture(scope="module", autouse=True)
def single_process_group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def prompts(tokenizer) -> list[list[int]]:
    return [chat_prompt_ids(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                             pad_token_id=model.config.pad_token_id)  # one sequence: ends at EOS unpadded
    return out[0, len(ids):].tolist()


def full(param: torch.Tensor) -> torch.Tensor:
    """A parameter's whole value, sharded (a DTensor) or not."""
    param = param.detach()
    return param.full_tensor() if hasattr(param, "full_tensor") else param


def test_the_engine_serves_it_greedy_as_hf_generate(smollm2_dir, loaded):
    model, tok = loaded
    n = 16

    async def main(url):
        async with EngineClient(url) as client:
            replies = [await client.generate(ids, {"max_new_tokens": n, "temperature": 0})
                       for ids in prompts(tok)]
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            chat = await http.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": QUESTIONS[0]}], "max_tokens": n, "temperature": 0,
                "return_token_ids": True})
        return replies, chat

    with EngineProcess(smollm2_dir, args=["--max-running-requests", "4"]) as engine:
        replies, chat = asyncio.run(main(engine.url))
    for ids, reply in zip(prompts(tok), replies):
        assert reply.output_ids == hf_greedy(model, ids, n)
        assert reply.text.strip() and reply.text == tok.decode(reply.output_ids, skip_special_tokens=True)
        assert all(math.isfinite(lp) and lp <= 0 for lp in reply.logprobs)
    assert chat.status_code == 200, chat.text
    choice = chat.json()["choices"][0]
    assert choice["prompt_token_ids"] == prompts(tok)[0]
    assert choice["token_ids"] == replies[0].output_ids[: len(choice["token_ids"])]  # greedy: the same answer
    assert choice["message"]["content"] == tok.decode(choice["token_ids"], skip_special_tokens=True)
    assert "7" in choice["message"]["content"]


def test_the_trainer_trains_it_with_the_engines_logprobs(smollm2_dir, loaded):
    model, tok = loaded
    engine = EngineCore(model, tok, EngineConfig(seed=0))
    backend = FSDP2Backend(ModelConfig(path=str(smollm2_dir)),
                           TrainerConfig(lr=1e-5, max_tokens_per_micro_batch=256),
                           temperature=TEMPERATURE, device="cpu")
    requests = rollout(engine, "0", prompts(tok), TEMPERATURE, max_new_tokens=8)
    assert_parity(backend, requests)
    before = {name: full(p).clone() for name, p in backend.model.named_parameters()}
    metrics = backend.train_step(as_items(requests), sft_loss_fn)
    assert math.isfinite(metrics["train/loss"]) and metrics["train/grad_norm"] > 0
    changed = [name for name, p in backend.model.named_parameters()
               if not torch.equal(full(p), before[name])]
    assert len(changed) == len(before)


def test_the_session_server_records_the_chat_templates_token_ids(smollm2_dir, loaded):
    from transformers import AutoTokenizer

    model, tok = loaded
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    expected_prompt = AutoTokenizer.from_pretrained(smollm2_dir).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False)

    async def main(engine_url):
        async with EngineClient(engine_url) as client, SessionServer(SessionManager(client, tok)) as server:
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
                sid = (await http.post("/sessions", json={})).json()["session_id"]
                oai = openai.AsyncOpenAI(base_url=f"{server.url}/sessions/{sid}/v1", api_key="unused", max_retries=0)
                reply = await oai.chat.completions.create(model="smollm2", messages=messages, max_tokens=10,
                                                          temperature=1.0, seed=0, logprobs=True)
                samples = (await http.post(f"/sessions/{sid}/samples")).json()["samples"]
        return reply, Sample.from_dict(samples[0]).validate()

    with BackgroundServer(EngineCore(model, tok, EngineConfig(max_running_requests=4))) as server:
        reply, sample = asyncio.run(main(server.url))
    assert sample.prompt_tokens == list(expected_prompt)
    response = sample.tokens[len(sample.prompt_tokens):]
    assert 0 < len(response) <= 10 and sample.loss_mask == [1] * len(response)
    assert reply.choices[0].message.content == tok.decode(response, skip_special_tokens=True)
    assert sample.rollout_logprobs == [c.logprob for c in reply.choices[0].logprobs.content]


def test_sft_trains_it_and_exports_what_transformers_loads(smollm2_dir, tmp_path):
    from verst.cli.main import main

    data = tmp_path / "data.jsonl"
    rows = [{"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "label": str(a + b)}
            for a, b in [(1, 2), (3, 4), (2, 5), (6, 1), (4, 4), (7, 2), (5, 3), (0, 9)]]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    run = tmp_path / "run"
    assert main(["sft", "--model.path", str(smollm2_dir), "--data.train-path", str(data), "--data.test-path",
                 str(data), "--run-dir", str(run), "--sft.num-steps", "2", "--sft.batch-size", "4",
                 "--eval.max-prompts", "2", "--rollout.max-response-tokens", "4", "--trainer.lr", "1e-5",
                 "--logging.tensorboard", "false", "--logging.progress", "false",
                 "--checkpoint.save", "false"]) == 0
    losses = [json.loads(line).get("train/loss") for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len([x for x in losses if x is not None]) == 2 and all(math.isfinite(x) for x in losses if x is not None)
    exported = load_model(run / "hf")
    assert type(exported).__name__ == "LlamaForCausalLM" and exported.config.tie_word_embeddings
    assert exported.config.vocab_size == 49152
    assert json.loads((run / "hf" / "tokenizer_config.json").read_text()).get("chat_template") or \
        (run / "hf" / "chat_template.jinja").exists()
