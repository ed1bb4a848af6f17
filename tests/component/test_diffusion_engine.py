"""The diffusion engine in a child process (`python -m verst.engine.diffusion_server`), driven over loopback:
its step log-probabilities against the trainer's recomputation, seeds, sglang-router in front, weight pushes
through the tensor, disk and distributed transports, pause and abort, and refusals naming the field."""

import asyncio

import httpx
import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")

from verst.data import shapes  # noqa: E402
from verst.engine.process import EngineProcess  # noqa: E402
from verst.inference_client.client import EngineClient  # noqa: E402
from verst.inference_client.images import ImageResult  # noqa: E402
from verst.inference_client.ports import free_port  # noqa: E402
from verst.inference_client.protocol import InvalidRequest  # noqa: E402
from verst.inference_client.replies import EngineError  # noqa: E402
from verst.inference_client.tensor_payload import serialize_named_tensors  # noqa: E402
from verst.inference_client.weights import broadcast_tensors, dtype_name, open_weight_update_group  # noqa: E402
from verst.models import diffusion  # noqa: E402
from verst.router.manager import RouterManager  # noqa: E402

torch.set_num_threads(1)
WIDTHS = (8, 16)
STEPS = 4
ENTRY = ["-m", "verst.engine.diffusion_server"]


def tiny(seed: int):
    return diffusion.init_denoiser(shapes.N_CLASSES, widths=WIDTHS, seed=seed)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("diffusion-engine") / "seed0"
    diffusion.save(tiny(0), path)
    return path


@pytest.fixture(scope="module")
def engine(base_dir):
    with EngineProcess(base_dir, entry=ENTRY, args=["--num-inference-steps", str(STEPS)], startup_timeout=120.0) as proc:
        yield proc


def run(coro):
    return asyncio.run(coro)


async def images(url, text="red circle", **params):
    async with EngineClient(url) as client:
        return await client.generate_images(text, {"num_inference_steps": STEPS, **params}, return_logprob=True)


def local_image(model, label: int, seed: int) -> np.ndarray:
    return diffusion.sample(model, torch.tensor([label]), seed=seed, steps=STEPS).images[0].numpy()


def test_step_logprobs_match_the_trainers_recomputation_and_seeds_fix_images(engine, base_dir):
    results = run(images(engine.url, sampling_seed=5, n=3))
    assert [r.seed for r in results] == [5, 6, 7] and all(r.finish_reason == {"type": "stop"} for r in results)
    model = diffusion.load(base_dir)
    latents = torch.from_numpy(np.stack([r.latents for r in results]))  # [3, steps + 1, 3, 16, 16]
    label = shapes.label_of("red circle")
    with torch.no_grad():
        recomputed = diffusion.step_logprobs(model, latents, torch.tensor([label] * 3))
    sent = torch.from_numpy(np.stack([r.logprobs for r in results]))
    assert sent.shape == (3, STEPS)
    assert (recomputed - sent).abs().max().item() <= 1e-5
    # n gives distinct images; one seed gives one image, alone or in a batch (within float32 noise: a batched
    # convolution sums in another order), here and in a local sampler
    assert np.abs(results[0].image - results[1].image).max() > 0.1
    again = run(images(engine.url, sampling_seed=6))
    assert np.allclose(again[0].image, results[1].image, atol=1e-5)
    assert np.allclose(results[0].image, local_image(model, label, 5), atol=1e-5)
    assert np.array_equal(results[0].image, np.clip(results[0].latents[-1], -1, 1))


def test_sglang_router_forwards_seed_and_n_and_a_dropped_setting_is_refused(engine):
    with RouterManager([engine.url], policy="round_robin") as router:
        # sglang-router 0.3.2 drops the sampling_params SGLang does not know: the engine's launch settings
        # (--num-inference-steps) apply, and the reply says what was used
        results = run(images(router.url, sampling_seed=11, n=2))
        assert [r.seed for r in results] == [11, 12] and len({r.rid for r in results}) == 2
        assert all(r.settings["num_inference_steps"] == STEPS and r.latents.shape[0] == STEPS + 1 for r in results)
        with pytest.raises(InvalidRequest, match="sampling_params.num_inference_steps"):
            run(images(router.url, sampling_seed=11, num_inference_steps=STEPS - 1))
    direct = run(images(engine.url, sampling_seed=11, num_inference_steps=STEPS - 1))  # straight to the engine
    assert direct[0].latents.shape[0] == STEPS and direct[0].settings["num_inference_steps"] == STEPS - 1


def test_a_bad_launch_setting_is_refused_naming_the_flag(base_dir):
    from verst.engine.diffusion_server import main

    with pytest.raises(SystemExit, match="--noise-level = 0: Input should be greater than 0"):
        main(["--model", str(base_dir), "--noise-level", "0"])


def test_weight_pushes_through_tensor_disk_and_distributed_set_the_version_and_the_images(engine, tmp_path):
    label = shapes.label_of("green square")

    async def probe(client):
        (result,) = await client.generate_images("green square", {"sampling_seed": 3, "num_inference_steps": STEPS})
        return result, await client.get_weight_version()

    async def main():
        async with EngineClient(engine.url) as client:
            pushed = tiny(1)
            payload = serialize_named_tensors(list(pushed.state_dict().items()))
            await client.pause()
            await client.update_weights_from_tensor([payload], weight_version="1")
            await client.continue_generation()
            after_tensor = await probe(client), pushed

            written = tiny(2)
            diffusion.save(written, tmp_path / "seed2")
            await client.update_weights_from_disk(str(tmp_path / "seed2"), "2")
            after_disk = await probe(client), written

            broadcast = tiny(3)
            named = list(broadcast.state_dict().items())
            port = free_port()
            group, _ = await asyncio.gather(
                asyncio.to_thread(open_weight_update_group, "127.0.0.1", port, 0, 2, "diffusion-wug", "gloo", 60.0),
                client.init_weights_update_group("127.0.0.1", port, 1, 2, "diffusion-wug", "gloo"),
            )
            tensors = [t for _, t in named]
            await asyncio.gather(
                asyncio.to_thread(broadcast_tensors, group, tensors),
                client.update_weights_from_distributed([n for n, _ in named], [dtype_name(t.dtype) for t in tensors],
                                                       [list(t.shape) for t in tensors], "3", "diffusion-wug"),
            )
            after_dist = await probe(client), broadcast
            httpx.post(engine.url + "/destroy_weights_update_group", json={"group_name": "diffusion-wug"}, timeout=10)
            # back to the served base, for the other tests
            await client.update_weights_from_disk(engine.model, "0")
            return after_tensor, after_disk, after_dist

    for ((result, version), model), expected in zip(run(main()), ("1", "2", "3")):
        assert version == expected and result.weight_version == expected
        assert np.allclose(result.image, local_image(model, label, 3), atol=1e-5)


def test_pause_holds_requests_and_pause_abort_ends_them(engine):
    async def main():
        async with EngineClient(engine.url) as client:
            await client.pause("retract")
            held = asyncio.ensure_future(client.generate_images("blue triangle", {"num_inference_steps": STEPS}))
            await asyncio.sleep(0.3)
            assert not held.done()
            await client.continue_generation()
            (done,) = await held
            await client.pause("retract")
            aborted = asyncio.ensure_future(client.generate_images("blue triangle", {"num_inference_steps": STEPS}))
            await asyncio.sleep(0.3)
            reply = await client.pause("abort")
            (ended,) = await aborted
            await client.continue_generation()
            return done, reply, ended

    done, reply, ended = run(main())
    assert done.finish_reason["type"] == "stop" and done.image.shape == (3, 16, 16)
    assert reply["num_paused_requests"] == 1
    assert ended.finish_reason["type"] == "abort" and ended.image is None


@pytest.mark.parametrize(("body", "status", "field"), [
    ({"text": "purple circle"}, 400, "text"),
    ({"text": "red circle", "sampling_params": {"num_inference_steps": 0}}, 422, "sampling_params.num_inference_steps"),
    ({"text": "red circle", "sampling_params": {"n": 65}}, 422, "sampling_params.n"),
    ({"text": "red circle", "sampling_params": {"guidance_scale": "2"}}, 422, "sampling_params.guidance_scale"),
    ({"text": "red circle", "sampling_params": {"temperature": 0.5}}, 422, "sampling_params.temperature"),
    ({"input_ids": [1, 2]}, 422, "text"),
    ({"text": "red circle", "image_data": "x"}, 422, "body"),  # the message names image_data
])
def test_bad_generate_requests_are_refused_naming_the_field(engine, body, status, field):
    response = httpx.post(engine.url + "/generate", json=body, timeout=30)
    assert response.status_code == status, response.text
    assert response.json()["error"]["field"] == field


def test_bad_weight_pushes_are_refused_naming_the_field(engine, tmp_path):
    wrong = {"conv_in.weight": torch.zeros(1, 1)}
    payload = serialize_named_tensors(list(wrong.items()))

    async def main():
        async with EngineClient(engine.url) as client:
            refusals = []
            for call in (
                client.update_weights_from_tensor([payload], weight_version="9"),
                client.update_weights_from_tensor([payload], weight_version="9", lora_name="a", lora_config={}),
                client.update_weights_from_disk(str(tmp_path / "absent"), "9"),
            ):
                with pytest.raises(EngineError) as caught:
                    await call
                refusals.append((caught.value.status, caught.value.field))
            return refusals, await client.get_weight_version()

    refusals, version = run(main())
    assert refusals == [(400, "shapes"), (400, "lora_name"), (400, "model_path")]
    assert version == "0"


def test_a_reply_round_trips_its_arrays_exactly():
    from verst.types.arrays import encode_array

    image = np.random.default_rng(0).standard_normal((3, 16, 16)).astype(np.float32)
    reply = {"image": encode_array(image), "meta_info": {
        "id": "r", "seed": 1, "label": 4, "weight_version": "0", "finish_reason": {"type": "stop"}, "num_inference_steps": 2,
        "guidance_scale": 1.0, "noise_level": 0.7, "latents": encode_array(image[None].repeat(3, 0)),
        "step_logprobs": [0.5, 0.25]}}
    result = ImageResult.from_reply(reply)
    assert np.array_equal(result.image, image) and result.label == 4 and result.latents.shape == (3, 3, 16, 16)


def test_verst_diffusion_serve_starts_the_engine(base_dir):
    with EngineProcess(base_dir, entry=["-m", "verst.cli.main", "diffusion", "serve"]) as proc:
        assert httpx.get(proc.url + "/health_generate", timeout=30).status_code == 200
        info = httpx.get(proc.url + "/get_model_info", timeout=30).json()
    assert info["weight_version"] == "0" and info["num_classes"] == shapes.N_CLASSES


def test_requests_that_arrive_together_are_sampled_as_one_batch(engine):
    """16 requests at once (two settings): fewer forwards than images, and each image is its seed's."""
    def counters():
        return httpx.get(engine.url + "/get_server_info", timeout=10).json()["internal_states"][0]

    async def many():
        async with EngineClient(engine.url) as client:
            return await asyncio.gather(*(client.generate_images(
                "blue square", {"num_inference_steps": STEPS, "sampling_seed": 100 + i,
                                "noise_level": 0.7 if i % 2 else 0.5}) for i in range(16)))

    before = counters()
    replies = run(many())
    after = counters()
    assert after["images"] - before["images"] == 16
    assert after["batches"] - before["batches"] < 16  # one batch per settings per turn of the engine's thread
    alone = run(images(engine.url, text="blue square", sampling_seed=103))[0]  # seed 103 had noise level 0.7
    assert np.allclose(replies[3][0].image, alone.image, atol=1e-5)
