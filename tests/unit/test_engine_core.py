"""The engine core without sockets: continuous batching, logprobs vs a full forward, prefix reuse, pause
modes, abort, weight loads, stop conditions and MoE routed experts, on tiny models made locally."""

import random

import numpy as np
import pytest
import torch

from verst.engine.core import EngineConfig, EngineCore
from verst.engine.request import Request
from verst.inference_client.protocol import InvalidRequest, SamplingParams
from verst.models.factory import init_model
from verst.models.loader import load_model, load_model_and_tokenizer

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine-core-models")
    return {arch: init_model(arch, "tiny", root / arch, seed=0) for arch in ("qwen3", "llama", "qwen3-moe")}


@pytest.fixture(scope="module")
def qwen(model_dirs):
    return load_model_and_tokenizer(model_dirs["qwen3"])


def make_core(model_and_tokenizer, **config):
    model, tokenizer = model_and_tokenizer
    return EngineCore(model, tokenizer, EngineConfig(**config))


def prompts(n, seed=0, lo=5, hi=40):
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def req(rid, prompt, max_new=12, temperature=1.0, seed=None, **sampling):
    return Request(rid=rid, prompt_ids=list(prompt), return_logprob=True, sampling=SamplingParams(
        temperature=temperature, max_new_tokens=max_new, sampling_seed=seed, ignore_eos=True, **sampling))


def run(core, reqs, max_steps=10_000):
    for r in reqs:
        core.add_request(r)
    steps = 0
    while core.has_work():
        core.step()
        steps += 1
        assert steps < max_steps, "engine did not finish"
    return reqs


def full_forward_logprobs(model, r):
    """log_softmax of one full-sequence forward, at the positions that produced each output token."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([r.prompt_ids + r.output_ids])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    p = len(r.prompt_ids)
    return lp[p - 1 : p - 1 + len(r.output_ids)].gather(1, torch.tensor(r.output_ids)[:, None])[:, 0]


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen3-moe"])
def test_logprobs_match_a_full_forward_and_greedy_matches_hf_generate(model_dirs, arch):
    model, tokenizer = load_model_and_tokenizer(model_dirs[arch])
    core = EngineCore(model, tokenizer, EngineConfig(max_running_requests=3))
    reqs = [req(f"r{i}", p, max_new=6 + 3 * i, temperature=0.0 if i % 3 == 0 else 1.0, seed=i)
            for i, p in enumerate(prompts(7, seed=1))]
    run(core, reqs)
    longest = max(reqs, key=lambda r: r.num_tokens)
    second_turn = req("turn2", longest.tokens() + [10, 11, 12], max_new=5, seed=99)
    run(core, [second_turn])
    assert second_turn.cached_tokens > 0
    for r in reqs + [second_turn]:
        diff = (full_forward_logprobs(model, r) - torch.tensor(r.output_logprobs)).abs().max().item()
        assert diff < 1e-4, f"{arch} {r.rid}: engine logprobs differ from a full forward by {diff}"
    for r in reqs[::3]:
        hf = model.generate(torch.tensor([r.prompt_ids]), max_new_tokens=len(r.output_ids), do_sample=False,
                            eos_token_id=None, pad_token_id=0)
        assert hf[0, len(r.prompt_ids):].tolist() == r.output_ids


def test_requests_join_between_steps_and_leave_when_done(qwen):
    core = make_core(qwen, max_running_requests=2)
    short, long, late = (req("short", [1, 2, 3], max_new=3), req("long", [4, 5, 6], max_new=12),
                         req("late", [7, 8, 9], max_new=4))
    for r in (short, long, late):
        core.add_request(r)
    history = []
    while core.has_work():
        core.step()
        history.append(({r.rid for r in core.running}, {r.rid for r in core.waiting}))
    assert history[0] == ({"short", "long"}, {"late"})
    joined = next(i for i, (running, _) in enumerate(history) if "late" in running)
    assert "long" in history[joined][0] and "short" not in history[joined][0]
    assert [len(r.output_ids) for r in (short, long, late)] == [3, 12, 4]
    assert all(r.finish.type == "length" for r in (short, long, late)) and core.running == []


def test_rows_moved_into_freed_slots_together_keep_their_kv(qwen):
    """Requests of ragged lengths finish at different steps; the rows from the end fill several freed slots
    in one copy, each keeping its own KV: every logprob still equals a full forward's."""
    model, _ = qwen
    core, copies = make_core(qwen, max_running_requests=8), []
    copy_rows = core.runner.cache.copy_rows
    core.runner.cache.copy_rows = lambda src, dst, n: (copies.append(len(src)), copy_rows(src, dst, n))[1]
    rng = random.Random(3)
    reqs = [req(f"r{i}", p, max_new=rng.randint(1, 19), seed=i) for i, p in enumerate(prompts(40, seed=3, hi=9))]
    run(core, reqs)
    assert max(copies) > 1  # some step moved several rows at once
    for r in reqs:
        diff = (full_forward_logprobs(model, r) - torch.tensor(r.output_logprobs)).abs().max().item()
        assert diff < 1e-4, f"{r.rid}: engine logprobs differ from a full forward by {diff}"


def test_second_turn_reuses_at_least_90_percent_and_matches_an_uncached_engine(qwen):
    turn1 = req("t1", prompts(1, seed=3, lo=60, hi=60)[0], max_new=30, temperature=0.0)
    cached = make_core(qwen)
    run(cached, [turn1])
    turn2_prompt = turn1.tokens() + [72, 105, 33]
    turn2 = run(cached, [req("t2", turn2_prompt, max_new=10, temperature=0.0)])[0]
    assert turn2.cached_tokens >= 0.9 * len(turn2_prompt), (turn2.cached_tokens, len(turn2_prompt))
    plain = run(make_core(qwen, prefix_cache_tokens=0), [req("t2", turn2_prompt, max_new=10, temperature=0.0)])[0]
    assert plain.cached_tokens == 0 and plain.output_ids == turn2.output_ids
    assert torch.allclose(torch.tensor(plain.output_logprobs), torch.tensor(turn2.output_logprobs), atol=1e-5)


def test_group_samples_share_the_prompt_prefill(qwen):
    core = make_core(qwen, max_running_requests=1)
    prompt = prompts(1, seed=4, lo=48, hi=48)[0]
    group = run(core, [req(f"g{i}", prompt, max_new=3, seed=i) for i in range(4)])
    assert group[0].cached_tokens == 0 and all(g.cached_tokens == len(prompt) - 1 for g in group[1:])


@pytest.mark.parametrize("arch", ["qwen3", "qwen3-moe"])
def test_samples_of_one_prompt_admitted_together_prefill_it_once(model_dirs, arch):
    model_and_tokenizer = load_model_and_tokenizer(model_dirs[arch])
    prompt, other = prompts(2, seed=11, lo=30, hi=30)
    group = [req(f"g{i}", prompt, max_new=5, seed=i) for i in range(6)] + [req("o", other, max_new=5, seed=9)]
    core = make_core(model_and_tokenizer, max_running_requests=8, prefix_cache_tokens=0)
    done = run(core, group)
    assert core.counters["prefill_tokens"] == 2 * 30  # the shared prompt once, the other prompt once
    assert [r.cached_tokens for r in done] == [0] + [29] * 5 + [0]
    for r in done:  # each sample as if it ran alone: same tokens, logprobs and routed experts
        alone = run(make_core(model_and_tokenizer, prefix_cache_tokens=0), [req(r.rid, r.prompt_ids, max_new=5,
                                                                             seed=r.sampling.sampling_seed)])[0]
        assert alone.output_ids == r.output_ids, r.rid
        assert torch.allclose(torch.tensor(alone.output_logprobs), torch.tensor(r.output_logprobs), atol=1e-5)
        if arch == "qwen3-moe":
            assert np.array_equal(alone.experts_array(), r.experts_array()), r.rid
    assert len({tuple(r.output_ids) for r in done[:6]}) > 1  # the samples are not copies of each other


def test_a_failed_prefill_forward_leaves_no_follower_behind(qwen):
    core = make_core(qwen, max_running_requests=8)
    group = [req(f"g{i}", [7, 8, 9], max_new=3, seed=i) for i in range(4)]
    for r in group:
        core.add_request(r)

    def broken(*args, **kwargs):
        raise RuntimeError("forward failed")

    core.runner.forward = broken
    with pytest.raises(RuntimeError, match="forward failed"):
        core.step()
    core.abort_all("engine step failed")  # what the engine thread does after a failed step
    assert [r.finish.type for r in group] == ["abort"] * 4
    assert not core.running and not core.waiting and not core.requests


def test_waiting_requests_are_admitted_by_priority_then_in_arrival_order(qwen):
    core = make_core(qwen, max_running_requests=1, prefix_cache_tokens=0)
    finished = []
    busy = req("busy", [1, 2, 3], max_new=2)
    busy.on_finish = lambda done: finished.append(done.rid)
    core.add_request(busy)
    core.step()  # busy holds the only slot; the others queue behind it
    queued = [req(rid, [4, 5], max_new=1, seed=0) for rid in ("low-a", "high-a", "low-b", "high-b", "top")]
    for r, priority in zip(queued, (0, 1, 0, 1, 5)):
        r.priority = priority
        r.on_finish = lambda done: finished.append(done.rid)
    run(core, queued)
    assert finished == ["busy", "top", "high-a", "high-b", "low-a", "low-b"]


def test_a_higher_priority_request_preempts_and_the_preempted_lose_nothing(qwen):
    lows = lambda: [req(f"low{i}", p, max_new=16, seed=10 + i) for i, p in enumerate(prompts(2, seed=7))]  # noqa: E731
    reference = run(make_core(qwen, max_running_requests=2), lows())
    core = make_core(qwen, max_running_requests=2)
    finished = []
    low = lows()
    for r in low:
        r.on_finish = lambda done: finished.append(done.rid)
        core.add_request(r)
    for _ in range(4):
        core.step()
    urgent = req("eval", [4, 5, 6], max_new=3, temperature=0.0)
    urgent.priority, urgent.on_finish = 1, lambda done: finished.append(done.rid)
    core.add_request(urgent)
    core.step()
    assert urgent in core.running and [r.rid for r in core.waiting] == ["low1"]  # the latest admitted yields
    run(core, [])
    assert finished[0] == "eval" and sorted(finished[1:]) == ["low0", "low1"]
    assert core.counters["preempted"] == 1
    assert low[1].cached_tokens == reference[1].cached_tokens  # cached_tokens stays the first admission's
    for mine, ref in zip(low, reference):
        assert mine.output_ids == ref.output_ids
        assert torch.allclose(torch.tensor(mine.output_logprobs), torch.tensor(ref.output_logprobs), atol=1e-5)


def test_without_preemption_a_higher_priority_request_waits_for_a_free_slot(qwen):
    core = make_core(qwen, max_running_requests=1, priority_preemption=False)
    finished = []
    low = req("low", [1, 2, 3], max_new=6, seed=0)
    urgent = req("eval", [4, 5], max_new=1, temperature=0.0)
    urgent.priority = 1
    for r in (low, urgent):
        r.on_finish = lambda done: finished.append(done.rid)
    core.add_request(low)
    core.step()
    run(core, [urgent])
    assert finished == ["low", "eval"] and core.counters["preempted"] == 0


def test_a_higher_priority_request_takes_a_free_slot_without_waiting_for_a_prefill_batch(qwen):
    core = make_core(qwen, max_running_requests=8, min_prefill_batch=4)
    lows = [req(f"low{i}", p, max_new=20, seed=i) for i, p in enumerate(prompts(7, seed=2))]
    for r in lows:
        core.add_request(r)
    core.step()
    later = [req(f"late{i}", [9, i], max_new=2, seed=0) for i in range(2)]
    for r in later:
        core.add_request(r)
    core.step()
    assert list(core.waiting) == later  # one free slot for two: they wait for a prefill batch of 4
    urgent = req("eval", [4, 5], max_new=2, temperature=0.0)
    urgent.priority = 1
    core.add_request(urgent)
    core.step()
    assert urgent in core.running and list(core.waiting) == later and core.counters["preempted"] == 0


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
def test_pause_mid_generation_then_continue_loses_and_duplicates_no_token(qwen, mode):
    batch = lambda: [req(f"p{i}", p, max_new=10, seed=100 + i) for i, p in enumerate(prompts(5, seed=5))]  # noqa: E731
    reference = run(make_core(qwen, max_running_requests=3), batch())
    core = make_core(qwen, max_running_requests=3)
    reqs = batch()
    for r in reqs:
        core.add_request(r)
    for _ in range(4):
        core.step()
    before = {r.rid: list(r.output_ids) for r in reqs}
    core.pause(mode)
    for _ in range(3):
        assert core.step() == 0
    assert {r.rid: r.output_ids for r in reqs} == before
    core.resume()
    while core.has_work():
        core.step()
    for r, ref in zip(reqs, reference):
        assert r.finished
        if mode == "abort":
            assert r.finish.type == "abort" and r.output_ids == ref.output_ids[: len(r.output_ids)]
        else:
            assert r.finish.type == "length" and r.output_ids == ref.output_ids, r.rid
            assert torch.allclose(torch.tensor(r.output_logprobs), torch.tensor(ref.output_logprobs), atol=1e-4)
    if mode == "retract":
        # recomputation after retract reused the KV the retracted requests left in the prefix cache
        assert core.counters["retracted"] == 3 and core.counters["cached_tokens"] > 0


def test_abort_one_then_all(qwen):
    core = make_core(qwen, max_running_requests=2)
    reqs = [req(f"a{i}", p, max_new=50) for i, p in enumerate(prompts(4, seed=6))]
    for r in reqs:
        core.add_request(r)
    core.step()
    assert core.abort("a0", "changed my mind") and not core.abort("nope")
    core.step()
    assert reqs[0].finish.type == "abort" and reqs[0].finish.message == "changed my mind"
    assert core.abort_all() == 3
    assert all(r.finish.type == "abort" for r in reqs) and not core.has_work()
    assert reqs[3].output_ids == [] and len(reqs[1].output_ids) >= 2


def test_loaded_weights_change_greedy_output_and_version(model_dirs, tmp_path):
    core = make_core(load_model_and_tokenizer(model_dirs["qwen3"]))
    other_dir = init_model("qwen3", "tiny", tmp_path / "other", seed=7)
    other = load_model(other_dir)
    prompt = prompts(1, seed=8)[0]
    run(core, [req("warm", prompt, max_new=4, temperature=0.0)])
    assert len(core.prefix_cache) > 0
    assert core.load_weights(other.state_dict().items(), "7") > 0
    assert core.weight_version == "7" and len(core.prefix_cache) == 0
    got = run(core, [req("after", prompt, max_new=8, temperature=0.0)])[0]
    hf = other.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert got.output_ids == hf[0, len(prompt):].tolist() and got.weight_version == "7"
    with pytest.raises(InvalidRequest, match="not a weight of the model"):
        core.load_weights([("nope.weight", torch.zeros(1))], "8")
    with pytest.raises(InvalidRequest, match="has shape"):
        core.load_weights([("model.norm.weight", torch.zeros(3))], "8")
    assert core.weight_version == "7"


def test_stop_tokens_eos_stop_strings_and_limits(qwen):
    model, tokenizer = qwen
    core = make_core(qwen, context_length=40)
    free = run(core, [req("free", [65, 66, 67], max_new=8, temperature=0.0)])[0]
    target = free.output_ids[3]
    by_id = Request("id", [65, 66, 67], SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=[target]))
    text = tokenizer.decode(free.output_ids, skip_special_tokens=False)
    stop_str = text[2:4]
    by_str = Request("str", [65, 66, 67], SamplingParams(temperature=0.0, max_new_tokens=8, stop=[stop_str]))
    banned = Request("min", [65, 66, 67], SamplingParams(temperature=0.0, max_new_tokens=8, min_new_tokens=8,
                                                  stop_token_ids=[target]))
    zero = Request("zero", [65, 66, 67], SamplingParams(max_new_tokens=0))
    ctx = Request("ctx", list(range(30)), SamplingParams(temperature=0.0, max_new_tokens=None, ignore_eos=True))
    run(core, [by_id, by_str, banned, zero, ctx])
    first = free.output_ids.index(target)
    assert by_id.output_ids == free.output_ids[: first + 1]
    assert by_id.finish.to_json() == {"type": "stop", "matched": target}
    assert by_str.finish.matched == stop_str and stop_str not in by_str.text
    assert target not in banned.output_ids and banned.finish.type == "length"
    assert zero.output_ids == [] and zero.finish.to_json() == {"type": "length", "length": 0}
    assert ctx.num_tokens == 40 and ctx.finish.type == "length"
    eos = sorted(core.eos_ids)[0]
    forced = Request("eos", [65], SamplingParams(temperature=0.0, max_new_tokens=5, stop_token_ids=[], min_new_tokens=0))
    core.load_weights([("lm_head.weight", _favour(model, eos))], None)  # make eos the greedy choice
    run(core, [forced])
    assert forced.output_ids == [eos] and forced.finish.matched == eos


def _favour(model, token):
    weight = model.get_output_embeddings().weight.detach().clone()
    weight[token] = weight.abs().max() * 50 * torch.sign(model.model.norm.weight.detach())
    return weight


def test_moe_routed_experts_match_the_model_router(model_dirs):
    model, tokenizer = load_model_and_tokenizer(model_dirs["qwen3-moe"])
    core = EngineCore(model, tokenizer, EngineConfig(max_running_requests=2))
    reqs = run(core, [req(f"m{i}", p, max_new=6, seed=i) for i, p in enumerate(prompts(3, seed=9))])
    turn2 = run(core, [req("m2", reqs[0].tokens() + [1, 2], max_new=4, seed=5)])[0]
    top_k = model.config.num_experts_per_tok
    for r in reqs + [turn2]:
        tokens = r.tokens()[:-1]
        with torch.no_grad():
            out = model(input_ids=torch.tensor([tokens]), output_router_logits=True)
        expected = torch.stack([lg.topk(top_k, -1).indices for lg in out.router_logits], dim=1)  # [seq, layers, k]
        got = torch.from_numpy(r.experts_array()).long()
        assert got.shape == (len(r.tokens()) - 1, model.config.num_hidden_layers, top_k)
        assert torch.equal(got, expected), r.rid


def test_invalid_requests_are_refused_by_field(qwen):
    core = make_core(qwen, context_length=16)
    cases = [
        (Request("e", [], SamplingParams()), "input_ids", "empty"),
        (Request("v", [1, 300], SamplingParams()), "input_ids", "outside the vocabulary"),
        (Request("l", list(range(16)), SamplingParams()), "input_ids", "shorter than the context length"),
        (Request("s", [1], SamplingParams(stop_token_ids=[-1])), "sampling_params.stop_token_ids", "outside"),
    ]
    for bad, field, message in cases:
        with pytest.raises(InvalidRequest, match=message) as info:
            core.add_request(bad)
        assert info.value.field == field
    first = Request("dup", [1, 2], SamplingParams(max_new_tokens=2))
    core.add_request(first)
    with pytest.raises(InvalidRequest, match="still in flight"):
        core.add_request(Request("dup", [1, 2], SamplingParams()))
    while core.has_work():
        core.step()
    assert first.finished and 1 <= len(first.output_ids) <= 2


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_sliding_window_layers_and_eager_attention_match_a_full_forward(attention):
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, max_position_embeddings=256, use_sliding_window=True, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], attn_implementation=attention,
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
    core = EngineCore(model, None, EngineConfig(max_running_requests=2))
    reqs = run(core, [req(f"w{i}", p, max_new=20, seed=i) for i, p in enumerate(prompts(3, seed=10, lo=10, hi=30))])
    for r in reqs:
        diff = (full_forward_logprobs(model, r) - torch.tensor(r.output_logprobs)).abs().max().item()
        assert diff < 1e-4, f"{attention} {r.rid}: {diff}"
