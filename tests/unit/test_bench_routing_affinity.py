"""The pure parts of bench/routing_affinity.py: the seeded workload, the growing context of a session, the
ideal-reuse bound and the hit-rate / switch / shortfall accounting."""

import asyncio
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from verst.inference_client.client import GenerateResult

_PATH = Path(__file__).resolve().parents[2] / "bench" / "routing_affinity.py"
_spec = importlib.util.spec_from_file_location("bench_routing_affinity", _PATH)
bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bench  # dataclasses look their module up by name
_spec.loader.exec_module(bench)


def test_plans_are_seeded_and_sized_within_their_ranges():
    plans = bench.make_plans(sessions=5, turns=4, prompt_tokens=100, message_tokens=10, seed=3)
    assert plans == bench.make_plans(5, 4, 100, 10, seed=3)
    assert plans != bench.make_plans(5, 4, 100, 10, seed=4)
    assert len({p.session_id for p in plans}) == 5
    for p in plans:
        assert 75 <= len(p.first_prompt) <= 125
        assert len(p.messages) == 3 and all(5 <= len(m) <= 15 for m in p.messages)
        assert all(0 <= t < 256 for t in p.first_prompt + sum(p.messages, []))
        assert bench.final_context(p, reply_tokens=8) == len(p.first_prompt) + sum(map(len, p.messages)) + 4 * 8


class FakeEngine:
    """Stands in for the router: replies with `reply` fixed tokens and reports a chosen cached count."""

    def __init__(self, reply):
        self.reply, self.prompts, self.keys = reply, [], []

    async def generate(self, input_ids, sampling_params, *, routing_key=None, return_logprob=True):
        self.prompts.append(list(input_ids))
        self.keys.append(routing_key)
        return GenerateResult(
            rid="r", output_ids=list(self.reply), logprobs=None, finish_reason="length", matched=None,
            prompt_tokens=len(input_ids), completion_tokens=len(self.reply), cached_tokens=len(input_ids) // 2,
            weight_version="e1", text="", routed_experts_flat=None, meta_info={})


def test_a_session_resends_context_plus_reply_plus_new_message_and_bounds_reuse():
    plan = bench.SessionPlan("s", 7, first_prompt=[1] * 20, messages=[[2] * 3, [3] * 4])
    engine = FakeEngine(reply=[9, 9, 9, 9, 9])
    records = asyncio.run(bench.run_session(engine, plan, turns=3, reply_tokens=5))
    assert engine.prompts == [[1] * 20, [1] * 20 + [9] * 5 + [2] * 3, [1] * 20 + [9] * 5 + [2] * 3 + [9] * 5 + [3] * 4]
    assert engine.keys == ["s", "s", "s"]
    # the reply's last token has no KV in the engine: reuse is at most previous prompt + reply - 1
    assert [r.ideal_cached for r in records] == [0, 24, 32]
    assert [r.prompt_tokens for r in records] == [20, 28, 37]
    assert [r.cached_tokens for r in records] == [10, 14, 18]


def test_a_reply_that_stops_early_fails_loudly():
    engine = FakeEngine(reply=[9])
    plan = bench.SessionPlan("s", 7, first_prompt=[1] * 20, messages=[[2]])

    async def early(*a, **k):
        result = await FakeEngine.generate(engine, *a, **k)
        result.finish_reason = "stop"
        return result

    engine.generate = early
    with pytest.raises(RuntimeError, match="finish_reason 'stop'"):
        asyncio.run(bench.run_session(engine, plan, turns=2, reply_tokens=1))


def rec(session, turn, engine, prompt, cached, ideal):
    return bench.TurnRecord(session, turn, engine, prompt, cached, completion_tokens=4, ideal_cached=ideal,
                            latency_s=0.5 + turn)


def test_summary_counts_hit_rates_switches_and_shortfalls():
    records = [
        rec("a", 0, "e0", 100, 0, 0), rec("a", 1, "e0", 120, 103, 103), rec("a", 2, "e1", 140, 0, 123),
        rec("b", 0, "e1", 100, 0, 0), rec("b", 1, "e1", 120, 90, 103),
    ]
    s = bench.summarize(records, wall_s=2.0)
    assert s["hit_rate_later"] == pytest.approx((103 + 0 + 90) / (120 + 140 + 120))
    assert s["ideal_hit_rate_later"] == pytest.approx((103 + 123 + 103) / 380)
    assert s["hit_rate_all"] == pytest.approx(193 / 580)
    assert s["engine_switch_rate"] == pytest.approx(1 / 3)
    assert s["turns_short_of_ideal"] == 2
    assert s["short_on_same_engine"] == 1  # b's turn 1 stayed on e1 and still missed: eviction
    assert s["recomputed_prompt_tokens"] == 580 - 193
    assert s["output_tokens"] == 20 and s["output_tokens_per_s"] == 10.0
    assert s["sessions_per_engine"] == {"e0": 1, "e1": 1}
    assert s["latency_p90_s"] == 2.5


def test_sizes_beyond_the_model_context_are_refused_and_the_cache_holds_every_session(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 1024}))
    args = bench.parse_args(["--sessions", "64", "--turns", "8"])
    plans = bench.make_plans(args.sessions, args.turns, args.prompt_tokens, args.message_tokens, args.seed)
    longest, cache = bench.check_sizes(tmp_path, plans, args)
    assert longest <= 1024
    assert cache >= sum(bench.final_context(p, args.reply_tokens) for p in plans)
    big = bench.parse_args(["--turns", "20"])
    big_plans = bench.make_plans(2, big.turns, big.prompt_tokens, big.message_tokens, 0)
    with pytest.raises(ValueError, match="max_position_embeddings is 1024"):
        bench.check_sizes(tmp_path, big_plans, big)


def test_unknown_configuration_names_are_refused():
    with pytest.raises(SystemExit):
        bench.parse_args(["--configs", "affinity,cache_aware"])
