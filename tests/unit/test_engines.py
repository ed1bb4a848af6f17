"""The engine seam without a real server: engine kinds and their refusals, flag pass-through from the CLI
and recipes, the vLLM adapter's mapping (against a recorded fake of vLLM's HTTP API) and the gateway."""

import asyncio
import json

import httpx
import pytest

from verst.cli.preflight import PreflightError, preflight
from verst.config.engine_flags import flag_argv
from verst.config.load import ConfigError, load_config
from verst.engine_kinds import EngineAPI, engine_kind
from verst.engine_kinds import kinds as kinds_module
from verst.engine_kinds.gateway import create_app, vllm_command, vllm_env
from verst.engine_kinds.kinds import preflight_problems
from verst.engine_kinds.sglang_launcher import sglang_command
from verst.engine_kinds.untie import LM_HEAD_FILE, ties_embeddings, untied_view, with_untied_override
from verst.engine_kinds.vllm import VLLMAdapter
from verst.inference_client.client import EngineClient, EngineError
from verst.run.setup import engine_server_args

VLLM_DISK = ["--cluster.engine", "vllm", "--sync.transport", "disk"]


# ---- flags and config ------------------------------------------------------------------------------
def test_flags_pass_through_unchanged_from_cli_and_recipe(tmp_path):
    cfg = load_config(None, [*VLLM_DISK, "--vllm.max-num-seqs", "8", "--vllm.enforce-eager",
                             "--vllm.max_model_len=512", "--vllm.stop-ids", "[1, 2]"])
    assert cfg.vllm == {"max-num-seqs": 8, "enforce-eager": True, "max_model_len": 512, "stop-ids": [1, 2]}
    assert flag_argv("vllm", cfg.vllm) == ["--max-num-seqs", "8", "--enforce-eager", "--max_model_len", "512",
                                           "--stop-ids", "1", "2"]
    recipe = tmp_path / "r.toml"
    recipe.write_text('[cluster]\nengine = "sglang"\n[sglang]\nmem-fraction-static = 0.7\nenable-metrics = true\n')
    cfg = load_config(recipe, ["--sglang.tp-size", "2"])
    assert cfg.sglang == {"mem-fraction-static": 0.7, "enable-metrics": True, "tp-size": 2}
    args = engine_server_args(cfg)
    flags = json.loads(args[args.index("--engine-flags") + 1])
    assert flags == ["--mem-fraction-static", "0.7", "--enable-metrics", "--tp-size", "2"]


@pytest.mark.parametrize("overrides, names", [
    (["--cluster.engine", "vllm"], "sync.transport = 'distributed' is not supported with cluster.engine = 'vllm'"),
    (["--cluster.engine", "vllm", "--sync.transport", "tensor"], "sync.transport = 'tensor'"),
    ([*VLLM_DISK, "--lora.enabled", "true"], "lora.enabled = true is not supported with cluster.engine = 'vllm'"),
    ([*VLLM_DISK, "--model.impl", "native"], "model.impl = 'native'"),
    (["--vllm.enforce-eager"], r"\[vllm\] flags \(enforce-eager\) are given, but cluster.engine = 'embedded'"),
    ([*VLLM_DISK, "--sglang.tp-size", "2"], r"\[sglang\] flags"),
    ([*VLLM_DISK, "--vllm.port", "8000"], "vllm.port: verst sets --port itself"),
    ([*VLLM_DISK, "--vllm.model", "x"], "vllm.model: verst sets --model itself"),
    (["--cluster.engine", "sglang", "--sglang.model-path", "x"], "sglang.model-path: verst sets"),
    ([*VLLM_DISK, "--vllm.enable-prefix-caching", "false"], "vllm.enable-prefix-caching = false"),
    (["--cluster.engine", "sglang", "--lora.enabled", "true", "--sync.transport", "disk"],
     "lora.enabled = true with cluster.engine = 'sglang' needs sglang.enable-lora = true"),
    (["--cluster.engine", "sglang", "--cluster.placement", "colocated", "--sync.transport", "tensor"],
     "cluster.placement = 'colocated' with cluster.engine = 'sglang' needs sglang.enable-memory-saver = true"),
])
def test_what_an_engine_cannot_do_is_refused_at_config_load(overrides, names):
    with pytest.raises(ConfigError, match=names):
        load_config(None, overrides)


def test_accepted_engine_configs():
    assert load_config(None, VLLM_DISK).cluster.engine == "vllm"
    colocated = ["--cluster.placement", "colocated", "--sync.transport", "tensor", "--cluster.device", "cuda"]
    assert load_config(None, colocated).sync.transport == "tensor"  # the embedded engine takes CUDA-IPC handles
    sglang = load_config(None, [*colocated, "--cluster.engine", "sglang", "--sglang.enable_memory_saver"])
    assert sglang.cluster.placement == "colocated"
    for transport in ("distributed", "tensor", "disk"):
        assert load_config(None, ["--cluster.engine", "sglang", "--sync.transport", transport]).sync.transport == transport


def test_server_args_per_kind():
    embedded = load_config(None, [])
    assert engine_server_args(embedded) == ["--weight-version", "0", "--model-impl", "auto"]
    cfg = load_config(None, [*VLLM_DISK, "--cluster.engine-python", "/opt/vllm/bin/python", "--vllm.enforce-eager"])
    assert engine_server_args(cfg, version=3) == [
        "--dtype", "float32", "--engine-flags", '["--enforce-eager"]', "--engine-python", "/opt/vllm/bin/python",
        "--weight-version", "3"]
    assert engine_kind("vllm").entry == ("-m", "verst.engine_kinds.gateway")
    with pytest.raises(ValueError, match="cluster.engine = 'tgi' is not registered; registered: embedded, vllm, sglang"):
        engine_kind("tgi")


def test_engine_commands():
    cmd = vllm_command("/py", "/m", 1234, "float32", ["--enforce-eager"])
    assert cmd[:3] == ["/py", "-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--logprobs-mode") + 1] == "processed_logprobs" and cmd[-1] == "--enforce-eager"
    assert cmd[cmd.index("--scheduling-policy") + 1] == "priority"
    assert "processed_logprobs" not in vllm_command("/py", "/m", 1, "float32", ["--logprobs-mode", "raw_logprobs"])
    assert "priority" not in vllm_command("/py", "/m", 1, "float32", ["--scheduling_policy=fcfs"])
    env = vllm_env({"VLLM_CPU_KVCACHE_SPACE": "4", "OMP_NUM_THREADS": "1"})
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "4" and env["VLLM_SERVER_DEV_MODE"] == "1" and "OMP_NUM_THREADS" not in env
    cmd = sglang_command("/py", "/m", "127.0.0.1", 5, "bfloat16", "0", "cuda", ["--tp-size", "2"])
    assert cmd[:3] == ["/py", "-m", "sglang.launch_server"] and cmd[-2:] == ["--tp-size", "2"]
    assert cmd[cmd.index("--weight-version") + 1] == "0" and cmd[cmd.index("--model-path") + 1] == "/m"
    assert "--enable-return-routed-experts" not in cmd
    assert "--enable-return-routed-experts" in sglang_command("/py", "/m", "h", 5, "bfloat16", "0", "cuda", [], True)


# ---- preflight -----------------------------------------------------------------------------------------
def test_preflight_names_a_missing_engine_environment(tmp_path, monkeypatch):
    missing = str(tmp_path / "no-venv" / "bin" / "python")
    assert "cluster.engine_python: the engine's Python" in preflight_problems("vllm", missing)[0]
    monkeypatch.setenv("VERST_VLLM_PYTHON", missing)
    assert "make vllm" in preflight_problems("vllm", None)[0]
    assert preflight_problems("embedded", None) == []


def test_preflight_refuses_sglang_without_cuda(monkeypatch, tiny_model_dir, addition_data_dir, tmp_path):
    monkeypatch.setattr(kinds_module, "module_found", lambda python, module: True)
    monkeypatch.setattr(kinds_module, "cuda_visible", lambda: False)
    assert "cluster.engine = 'sglang' needs a CUDA GPU" in preflight_problems("sglang", None)[0]
    cfg = load_config(None, ["--cluster.engine", "sglang", "--model.path", str(tiny_model_dir),
                             "--data.train-path", str(addition_data_dir / "train.jsonl"),
                             "--data.test-path", str(addition_data_dir / "test.jsonl"),
                             "--run-dir", str(tmp_path / "run")])
    with pytest.raises(PreflightError, match="cluster.engine = 'sglang' needs a CUDA GPU"):
        preflight(cfg, rl=True)


# ---- the vLLM adapter, against a recorded fake of vLLM's HTTP API ------------------------------------
class FakeVLLM:
    """Answers vLLM's routes as vLLM 0.32 does (shapes read from a real server) and records each call."""

    def __init__(self):
        self.calls: list[tuple[str, dict, dict]] = []
        self.hold = asyncio.Event()

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else {}
        self.calls.append((request.url.path, dict(request.url.params), body))
        path = request.url.path
        if path == "/v1/completions":
            if body["prompt"] == [9]:
                await self.hold.wait()  # a request in flight until aborted
            n = body["max_tokens"]
            return httpx.Response(200, json={"choices": [{
                "text": "ab", "token_ids": list(range(10, 10 + n)), "finish_reason": "length", "stop_reason": None,
                "logprobs": {"token_logprobs": [-0.5] * n}}],
                "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}})
        if path in ("/pause", "/resume", "/update_weight_version", "/abort_requests"):
            return httpx.Response(200, json={"status": "ok"})
        if path == "/reset_prefix_cache":
            return httpx.Response(200, json={"success": True})
        if path == "/collective_rpc":
            return httpx.Response(200, json={"results": [None]})
        if path == "/load":
            return httpx.Response(200, json={"server_load": 2})
        if path == "/health":
            return httpx.Response(200)
        return httpx.Response(404, json={"detail": "Not Found"})


@pytest.fixture()
def fake():
    return FakeVLLM()


def adapter(fake, version="0"):
    return VLLMAdapter("http://vllm", weight_version=version, model_info={"model_path": "/m", "vocab_size": 265},
                       transport=httpx.MockTransport(fake))


def test_generate_maps_sglang_fields_to_vllm_and_back(fake):
    asyncio.run(_generate_maps_sglang_fields_to_vllm_and_back(fake))


async def _generate_maps_sglang_fields_to_vllm_and_back(fake):
    engine = adapter(fake, "4")
    assert isinstance(engine, EngineAPI) and isinstance(EngineClient("http://x"), EngineAPI)
    reply = await engine.generate([1, 2, 3], {"max_new_tokens": 3, "temperature": 0.7, "top_k": -1,
                                              "sampling_seed": 5, "ignore_eos": True, "no_stop_trim": True}, rid="r1")
    _, _, body = fake.calls[0]
    assert body == {"prompt": [1, 2, 3], "return_token_ids": True, "max_tokens": 3, "logprobs": 0, "temperature": 0.7,
                    "top_k": 0, "seed": 5, "ignore_eos": True, "include_stop_str_in_output": True, "request_id": "r1"}
    meta = reply["meta_info"]
    assert reply["output_ids"] == [10, 11, 12] and meta["output_token_logprobs"] == [[-0.5, t, None] for t in (10, 11, 12)]
    assert meta["finish_reason"] == {"type": "length", "length": 3} and meta["weight_version"] == "4"
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["id"]) == (3, 3, "r1")
    with pytest.raises(ValueError, match="sampling_params.regex"):
        await engine.generate([1], {"regex": "a+"})
    await engine.close()


def test_abort_pause_flush_and_weights_map_to_vllm_routes(fake):
    asyncio.run(_abort_pause_flush_and_weights_map_to_vllm_routes(fake))


async def _abort_pause_flush_and_weights_map_to_vllm_routes(fake):
    engine = adapter(fake)
    call = asyncio.create_task(engine.generate([9], {"max_new_tokens": 2}, rid="long"))
    await asyncio.sleep(0.05)
    await engine.abort("long")
    aborted = await call
    assert aborted["meta_info"]["finish_reason"] == {"type": "abort"} and aborted["output_ids"] == []
    await engine.pause("retract")
    await engine.flush_cache()
    await engine.update_weights_from_disk("/snap/v2", "2")
    await engine.continue_generation()
    routes = [(path, params, body) for path, params, body in fake.calls[1:]]
    assert routes == [
        ("/pause", {"mode": "keep"}, {}), ("/reset_prefix_cache", {"reset_running_requests": "true"}, {}),
        ("/collective_rpc", {}, {"method": "reload_weights", "kwargs": {"weights_path": "/snap/v2"}}),
        ("/update_weight_version", {}, {"new_version": "2"}), ("/resume", {}, {})]
    assert await engine.get_weight_version() == "2"
    assert (await engine.get_model_info())["vocab_size"] == 265 and (await engine.get_load())[0]["num_reqs"] == 2
    await engine.pause("abort")
    assert fake.calls[-1][:2] == ("/pause", {"mode": "abort"})
    await engine.close()


# ---- the gateway: verst's client, unchanged, drives the adapted engine ---------------------------------
def test_gateway_serves_the_sglang_dialect_over_an_adapter(fake):
    asyncio.run(_gateway_serves_the_sglang_dialect_over_an_adapter(fake))


async def _gateway_serves_the_sglang_dialect_over_an_adapter(fake):
    engine = adapter(fake, "7")
    app = create_app(engine, engine_name="vllm")
    async with EngineClient("http://gateway", transport=httpx.ASGITransport(app=app)) as client:
        result = await client.generate([1, 2], {"max_new_tokens": 2, "sampling_seed": 1}, priority=3)
        assert fake.calls[-1][2]["priority"] == -3  # SGLang's higher-first as vLLM's lower-first
        assert result.output_ids == [10, 11] and result.logprobs == [-0.5, -0.5] and result.weight_version == "7"
        assert result.finish_reason == "length"
        batch = await EngineClient("http://gateway", transport=httpx.ASGITransport(app=app), max_batch=4)._post(
            "/generate", {"input_ids": [[1], [2, 3]], "sampling_params": {"max_new_tokens": 1}}, 10.0)
        assert [len(r["output_ids"]) for r in batch] == [1, 1]
        await client.pause("in_place")
        await client.update_weights_from_disk("/snap", "8")
        await client.continue_generation()
        assert await client.get_weight_version() == "8" and await client.health()
        for call, field in [(client.generate([1], {"max_new_tokens": 1}, top_logprobs_num=2), "top_logprobs_num"),
                            (client.generate([1], {"json_schema": "{}"}), "sampling_params"),
                            (client.update_weights_from_tensor("m", "1"), "path"),
                            (client.init_weights_update_group("127.0.0.1", 1, 1, 2), "path")]:
            with pytest.raises(EngineError) as refused:
                await call
            assert refused.value.status == 400 and refused.value.field == field, refused.value
            assert "embedded" not in refused.value.message
    await engine.close()


# ---- untied checkpoint views (vLLM-CPU keeps a tied lm_head's packed weights across reloads) -------------
def test_untied_view_spells_out_the_output_embedding(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    assert ties_embeddings(tiny_model_dir)
    view = untied_view(tiny_model_dir, tmp_path / "view")
    weights = load_file(str(view / "model.safetensors"))
    head = load_file(str(view / LM_HEAD_FILE))["lm_head.weight"]
    assert head.equal(weights["model.embed_tokens.weight"]) and (view / "tokenizer.json").is_symlink()
    assert with_untied_override(["--enforce-eager"])[-2:] == ["--hf-overrides", '{"tie_word_embeddings": false}']
    merged = with_untied_override(["--hf-overrides", '{"max_position_embeddings": 64}'])
    assert json.loads(merged[1]) == {"max_position_embeddings": 64, "tie_word_embeddings": False}
    assert json.loads(with_untied_override(['--hf-overrides={"a": 1}'])[0].split("=", 1)[1])["tie_word_embeddings"] is False
