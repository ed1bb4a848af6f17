"""Session affinity vs round-robin routing: prefix-cache hit rate and throughput of concurrent multi-turn
sessions on N embedded engines behind sglang-router, both policies in one run. Target: hit rate >= 96%.

Each session sends a first prompt of a few hundred tokens, then turns that resend the whole context (first
prompt, every reply, every new user/tool message) plus a new message. Every request carries the session id
as routing key (`X-SMG-Routing-Key`): affinity is `--policy manual --assignment-mode min_load`, the baseline
`round_robin` ignores the key. The engines' prefix caches are flushed before each configuration (both start
cold) and sized so that nothing is evicted; replies ignore EOS, so both configurations send the same token
counts. Hit rate = sum cached_tokens / sum prompt_tokens (the engine's meta_info), over the turns after the
first (what routing decides) and over all turns (first prompts are always cold).

The engine keeps KV only for tokens it has fed: a reply's last sampled token is never fed, and a prompt's
last token is always recomputed. A later turn can therefore reuse at most previous prompt + previous reply
- 1 tokens; that ideal bound is printed next to each measured rate.

    .venv/bin/python bench/routing_affinity.py [--engines 4] [--sessions 32] [--turns 8] [--prompt-tokens 384]
        [--reply-tokens 32] [--message-tokens 16] [--model DIR] [--out result.json]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from verst.engine.process import EngineProcess  # noqa: E402
from verst.inference_client.client import EngineClient  # noqa: E402
from verst.inference_client.fleet import EngineFleet  # noqa: E402
from verst.router import RouterManager  # noqa: E402

TARGET_HIT_RATE = 0.96
PROMPT_ID_RANGE = 256  # byte ids of the tiny tokenizer: no special tokens inside prompts
CONFIGS = {  # name -> RouterManager keyword arguments
    "affinity": {"policy": "manual", "assignment_mode": "min_load"},
    "round_robin": {"policy": "round_robin"},
}
LABELS = {"affinity": "affinity (manual + min_load)", "round_robin": "round_robin"}


# ---- workload and accounting (pure) ---------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SessionPlan:
    """One session's user side: its first prompt and the new message appended before each later turn."""

    session_id: str
    seed: int
    first_prompt: list[int]
    messages: list[list[int]]  # len = turns - 1


@dataclasses.dataclass(frozen=True)
class TurnRecord:
    session_id: str
    turn: int
    engine: str  # the serving engine's label (its weight version)
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ideal_cached: int  # most the engine could have reused: previous prompt + previous reply - 1 (0 on turn 0)
    latency_s: float


def make_plans(sessions: int, turns: int, prompt_tokens: int, message_tokens: int, seed: int) -> list[SessionPlan]:
    """Random byte-id prompts: first prompts of 0.75-1.25x `prompt_tokens`, messages of 0.5-1.5x
    `message_tokens`; deterministic in `seed`, so every configuration sends the same user side."""
    plans = []
    for s in range(sessions):
        rng = random.Random(seed * 1_000_003 + s)
        n_first = rng.randint(max(1, prompt_tokens * 3 // 4), max(1, prompt_tokens * 5 // 4))
        first = [rng.randrange(PROMPT_ID_RANGE) for _ in range(n_first)]
        messages = []
        for _ in range(turns - 1):
            n = rng.randint(max(1, message_tokens // 2), max(1, message_tokens * 3 // 2))
            messages.append([rng.randrange(PROMPT_ID_RANGE) for _ in range(n)])
        plans.append(SessionPlan(f"session-{seed}-{s}", seed * 1_000_003 + s, first, messages))
    return plans


def final_context(plan: SessionPlan, reply_tokens: int) -> int:
    """Tokens of the session's last request plus its reply: what one engine must hold at the end."""
    return len(plan.first_prompt) + sum(len(m) for m in plan.messages) + (len(plan.messages) + 1) * reply_tokens


def _rate(num: int, den: int) -> float:
    return num / den if den else float("nan")


def summarize(records: list[TurnRecord], wall_s: float) -> dict[str, Any]:
    """Hit rates (measured and ideal), engine switches, turns short of ideal, throughput and latency."""
    later = [r for r in records if r.turn > 0]
    by_turn = {(r.session_id, r.turn): r for r in records}
    prev = {(r.session_id, r.turn): by_turn[(r.session_id, r.turn - 1)] for r in later}
    switched = [r for r in later if prev[(r.session_id, r.turn)].engine != r.engine]
    short = [r for r in later if r.cached_tokens < r.ideal_cached]
    sessions_per_engine: dict[str, int] = {}
    for r in records:
        if r.turn == 0:
            sessions_per_engine[r.engine] = sessions_per_engine.get(r.engine, 0) + 1
    prompt_all, prompt_later = sum(r.prompt_tokens for r in records), sum(r.prompt_tokens for r in later)
    output = sum(r.completion_tokens for r in records)
    latencies = sorted(r.latency_s for r in records)
    return {
        "requests": len(records),
        "hit_rate_later": _rate(sum(r.cached_tokens for r in later), prompt_later),
        "ideal_hit_rate_later": _rate(sum(r.ideal_cached for r in later), prompt_later),
        "hit_rate_all": _rate(sum(r.cached_tokens for r in records), prompt_all),
        "ideal_hit_rate_all": _rate(sum(r.ideal_cached for r in records), prompt_all),
        "engine_switch_rate": _rate(len(switched), len(later)),
        "turns_short_of_ideal": len(short),
        # on the engine that served the previous turn, a shortfall can only be eviction
        "short_on_same_engine": sum(1 for r in short if prev[(r.session_id, r.turn)].engine == r.engine),
        "prompt_tokens": prompt_all,
        "recomputed_prompt_tokens": prompt_all - sum(r.cached_tokens for r in records),
        "output_tokens": output,
        "wall_s": wall_s,
        "output_tokens_per_s": output / wall_s,
        "context_tokens_per_s": (prompt_all + output) / wall_s,
        "latency_mean_s": sum(latencies) / len(latencies),
        "latency_p90_s": latencies[min(len(latencies) - 1, int(0.9 * len(latencies)))],
        "sessions_per_engine": dict(sorted(sessions_per_engine.items())),
    }


# ---- driving the engines ----------------------------------------------------------------------------------
async def run_session(client: EngineClient, plan: SessionPlan, turns: int, reply_tokens: int) -> list[TurnRecord]:
    context, records, ideal = list(plan.first_prompt), [], 0
    for turn in range(turns):
        params = {"max_new_tokens": reply_tokens, "ignore_eos": True, "temperature": 1.0,
                  "sampling_seed": (plan.seed * 64 + turn) % 2**31}
        start = time.perf_counter()
        result = await client.generate(context, params, routing_key=plan.session_id, return_logprob=False)
        latency = time.perf_counter() - start
        if result.finish_reason != "length" or result.prompt_tokens != len(context):
            raise RuntimeError(f"{plan.session_id} turn {turn}: finish_reason {result.finish_reason!r}, "
                               f"prompt_tokens {result.prompt_tokens} for a prompt of {len(context)} tokens")
        records.append(TurnRecord(plan.session_id, turn, result.weight_version, result.prompt_tokens,
                                  result.cached_tokens, result.completion_tokens, ideal, latency))
        if turn + 1 < turns:
            ideal = len(context) + len(result.output_ids) - 1
            context = context + result.output_ids + plan.messages[turn]
    return records


async def engine_totals(fleet: EngineFleet) -> dict[str, dict[str, int]]:
    infos = await fleet.each("get_server_info", lambda c: c.get_server_info())
    return {url: info["internal_states"][0] for url, info in infos.items()}


async def run_config(router_url: str, engine_urls: list[str], plans: list[SessionPlan], args) -> dict[str, Any]:
    """Flush every engine's cache, run all sessions concurrently through the router, summarise."""
    async with EngineFleet(engine_urls) as fleet:
        await fleet.flush_cache()
        before = await engine_totals(fleet)
        async with EngineClient(router_url, affinity=True) as client:
            start = time.perf_counter()
            per_session = await asyncio.gather(*(run_session(client, p, args.turns, args.reply_tokens)
                                                 for p in plans))
            wall = time.perf_counter() - start
        after = await engine_totals(fleet)
    summary = summarize([r for records in per_session for r in records], wall)
    # the engines' own count of prefilled tokens, to cross-check the per-reply cached_tokens
    summary["engine_prefill_tokens"] = sum(after[u]["total_prefill_tokens"] - before[u]["total_prefill_tokens"]
                                           for u in engine_urls)
    summary["prefix_cache_tokens_at_end"] = [after[u]["prefix_cache_tokens"] for u in engine_urls]
    return summary


async def label_and_warm(engine_urls: list[str], plans: list[SessionPlan]) -> None:
    """Name each engine through its weight version (replies then say who served them) and run one
    request on each, so that neither configuration pays first-forward costs."""
    async with EngineFleet(engine_urls) as fleet:
        await asyncio.gather(*(fleet.clients[u].update_weight_version(f"e{i}") for i, u in enumerate(engine_urls)))
        await fleet.each("warm-up generate", lambda c: c.generate(
            plans[0].first_prompt, {"max_new_tokens": 4, "ignore_eos": True}, return_logprob=False))


# ---- set-up and report ------------------------------------------------------------------------------------
def start_engines(model: Path, args, cache_tokens: int, log_dir: Path | None) -> list[EngineProcess]:
    engine_args = ["--max-running-requests", str(args.max_running_requests),
                   "--prefix-cache-tokens", str(cache_tokens), "--seed", str(args.seed)]
    engines = []
    try:
        for i in range(args.engines):  # launched together: each loads torch in its own process
            log = log_dir / f"engine-{i}.log" if log_dir else None
            engines.append(EngineProcess(model, args=engine_args, log_path=log).start(wait=False))
        for engine in engines:
            engine.wait_ready()
    except BaseException:
        for engine in engines:
            engine.stop()
        raise
    return engines


def check_sizes(model: Path, plans: list[SessionPlan], args) -> tuple[int, int]:
    """(longest final context, prefix cache tokens per engine); fails if a session outgrows the model."""
    longest = max(final_context(p, args.reply_tokens) for p in plans)
    limit = json.loads((model / "config.json").read_text())["max_position_embeddings"]
    if longest > limit:
        raise ValueError(f"a session reaches {longest} tokens (--prompt-tokens {args.prompt_tokens}, --turns "
                         f"{args.turns}, --reply-tokens {args.reply_tokens}, --message-tokens {args.message_tokens}) "
                         f"but the model's max_position_embeddings is {limit}; use smaller sizes")
    # every session on every engine, with a margin: the affinity run never evicts, nor does round-robin
    needed = sum(final_context(p, args.reply_tokens) for p in plans) * 5 // 4
    cache = args.prefix_cache_tokens if args.prefix_cache_tokens is not None else max(32768, needed)
    return longest, cache


def print_report(results: dict[str, dict[str, Any]], args, longest: int, cache: int) -> dict[str, Any]:
    print(f"\n== {args.engines} engines behind sglang-router, {args.sessions} concurrent sessions x {args.turns} "
          f"turns: first prompt ~{args.prompt_tokens}, reply {args.reply_tokens}, new message "
          f"~{args.message_tokens} tokens (longest session {longest}); prefix cache {cache} tokens/engine")
    print(f"{'config':30} {'hit>1st':>8} {'ideal':>7} {'hit all':>8} {'ideal':>7} {'switch':>7} {'short':>6} "
          f"{'recomputed':>10} {'wall s':>7} {'out tok/s':>9} {'ctx tok/s':>9} {'lat s':>6} {'p90 s':>6}")
    for name, s in results.items():
        print(f"{LABELS[name]:30} {s['hit_rate_later']:8.1%} {s['ideal_hit_rate_later']:7.1%} "
              f"{s['hit_rate_all']:8.1%} {s['ideal_hit_rate_all']:7.1%} {s['engine_switch_rate']:7.1%} "
              f"{s['turns_short_of_ideal']:6d} {s['recomputed_prompt_tokens']:10d} {s['wall_s']:7.2f} "
              f"{s['output_tokens_per_s']:9.1f} {s['context_tokens_per_s']:9.1f} {s['latency_mean_s']:6.2f} "
              f"{s['latency_p90_s']:6.2f}")
    for name, s in results.items():
        spread = ", ".join(f"{e} {n}" for e, n in s["sessions_per_engine"].items())
        print(f"{LABELS[name]:30} sessions by first engine: {spread}; turns short of ideal on the same engine "
              f"(eviction): {s['short_on_same_engine']}; engine-counted prefill {s['engine_prefill_tokens']}")
    report: dict[str, Any] = {"configs": results}
    if {"affinity", "round_robin"} <= results.keys():
        a, r = results["affinity"], results["round_robin"]
        report["ratios"] = {
            "output_tokens_per_s": a["output_tokens_per_s"] / r["output_tokens_per_s"],
            "hit_rate_later": a["hit_rate_later"] / r["hit_rate_later"] if r["hit_rate_later"] else float("inf"),
            "recomputed_prompt_tokens": a["recomputed_prompt_tokens"] / r["recomputed_prompt_tokens"],
        }
        q = report["ratios"]
        print(f"affinity / round_robin: output tok/s {q['output_tokens_per_s']:.2f}x, hit rate after the first "
              f"turn {q['hit_rate_later']:.2f}x, recomputed prompt tokens {q['recomputed_prompt_tokens']:.2f}x")
    if "affinity" in results:
        a = results["affinity"]
        met = a["hit_rate_later"] >= TARGET_HIT_RATE
        report["target"] = {"hit_rate": TARGET_HIT_RATE, "measured": a["hit_rate_later"], "met": met}
        print(f"target: affinity hit rate over turns after the first {a['hit_rate_later']:.1%} >= "
              f"{TARGET_HIT_RATE:.0%}: {'met' if met else 'NOT met'} (ideal bound {a['ideal_hit_rate_later']:.1%}; "
              f"over all turns {a['hit_rate_all']:.1%}, ideal {a['ideal_hit_rate_all']:.1%}; the first prompt of "
              f"every session is cold)")
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--sessions", type=int, default=32, help="concurrent sessions (all run at once)")
    p.add_argument("--turns", type=int, default=8, help="requests per session, the first included")
    p.add_argument("--prompt-tokens", type=int, default=384, help="mean first-prompt length (0.75-1.25x)")
    p.add_argument("--reply-tokens", type=int, default=32, help="generated tokens per turn (EOS ignored)")
    p.add_argument("--message-tokens", type=int, default=16, help="mean new user/tool message (0.5-1.5x)")
    p.add_argument("--prefix-cache-tokens", type=int, default=None,
                   help="per engine; default: every session's final context x1.25, at least 32768")
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--configs", default="affinity,round_robin", help=f"order to run; of {', '.join(CONFIGS)}")
    p.add_argument("--model", default=None, help="checkpoint directory; default: the tiny qwen3 made in a temp dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default=None, help="write engine and router logs here")
    p.add_argument("--out", default=None, help="write the results as JSON to this file")
    args = p.parse_args(argv)
    for name in ("engines", "sessions", "turns", "prompt_tokens", "reply_tokens", "message_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    args.config_list = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in args.config_list if c not in CONFIGS]
    if unknown or not args.config_list:
        p.error(f"--configs {args.configs!r}: unknown {unknown}; choices: {', '.join(CONFIGS)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    log_dir = Path(args.log_dir) if args.log_dir else None
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="verst-bench-") as tmp:
        if args.model:
            model = Path(args.model)
        else:
            from verst.models.factory import init_model  # torch only where a model is made

            model = Path(init_model("qwen3", "tiny", Path(tmp) / "qwen3-tiny", seed=0))
        plans = make_plans(args.sessions, args.turns, args.prompt_tokens, args.message_tokens, args.seed)
        longest, cache = check_sizes(model, plans, args)
        engines = start_engines(model, args, cache, log_dir)
        try:
            urls = [e.url for e in engines]
            asyncio.run(label_and_warm(urls, plans))
            results = {}
            for name in args.config_list:
                log = log_dir / f"router-{name}.log" if log_dir else None
                with RouterManager(urls, log_path=log, **CONFIGS[name]) as router:
                    results[name] = asyncio.run(run_config(router.url, urls, plans, args))
        finally:
            for engine in engines:
                engine.stop()
    report = print_report(results, args, longest, cache)
    if args.out:
        report = {"args": {k: v for k, v in vars(args).items() if k != "config_list"}, "longest_session": longest,
                  "prefix_cache_tokens": cache, **report}
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    from _memory import report_peaks  # this script's folder is first on sys.path

    report_peaks(main)
