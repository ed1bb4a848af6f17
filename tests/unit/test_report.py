"""The run report's pure parts (series, units, smoothing, constant folding, the funnel, time, samples, lineage)
and the pages it writes for one run, an SFT run and an overlay."""

import json
import re

import pytest

from tests.unit.report_runs import rl_run, sft_run
from verst.cli.main import main
from verst.monitor.report import write_compare_report, write_report
from verst.monitor.report_data import (
    Run,
    build_series,
    ema,
    format_value,
    funnel,
    load_run,
    samples_per_s,
    split_constant,
    stale_drops_by_length,
    startup_phases,
    time_breakdown,
    unit_of,
)
from verst.monitor.samples import append_samples, examples, pick_steps, read_samples, sample_record
from verst.rollout.plugins import RolloutBatch
from verst.rollout.rollout_fn import dump_batch
from verst.types import Sample, Status


def figures_of(page: str) -> dict:
    blob = re.search(r'<script type="application/json" id="verst-figures">(.*?)</script>', page, re.S).group(1)
    return json.loads(blob.replace("<\\/", "</"))


def headings(page: str) -> list[str]:
    return re.findall(r"<h2>(.*?)</h2>", page)


def test_series_skip_non_numeric_and_non_finite_and_time_is_relative():
    records = [{"step": 0, "time": 100.0, "train/loss": 1.0, "sync/transport": "x"},
               {"step": 1, "time": 102.5, "train/loss": float("nan"), "train/ok": True},
               {"step": 2, "time": 103.0, "train/loss": 0.5}]
    series = build_series(records)
    assert set(series) == {"train/loss"}
    assert series["train/loss"].steps == [0, 2] and series["train/loss"].times == [0.0, 3.0]


@pytest.mark.parametrize("key, value, text", [
    ("eval/accuracy_after", 0.885, "88.5 %"), ("time/total_s", 39.83, "39.83 s"), ("sync/bytes", 2104832.0, "2.105 MB"),
    ("perf/rollout_tokens_per_s", 2849.9, "2,850 tokens/s"), ("rollout/response_length_mean", 3.5, "3.5 tokens"),
    ("buffer/dropped_stale", 741.0, "741 groups"), ("buffer/staleness_mean", 1.0, "1 versions"),
    ("rollout/idle_slot_fraction", 0.25, "25 %"), ("train/loss", 0.12, "0.12"), ("schedule", "fully_async", "fully_async"),
    ("sync/seconds", 0.05, "0.05 s"), ("train/lr", 1e-5, "1.000e-05"),
])
def test_units_and_formatting(key, value, text):
    assert format_value(key, value) == text


def test_unit_of_scales_fractions_to_percent():
    assert unit_of("rollout/truncated_ratio") == ("%", 100.0)
    assert unit_of("train/grad_norm") == ("", 1.0)


def test_ema_is_debiased_and_keeps_constants():
    assert ema([3.0] * 20) == pytest.approx([3.0] * 20)
    smoothed = ema([0.0, 10.0] * 10, weight=0.9)
    assert smoothed[0] == 0.0 and all(0.0 <= v <= 10.0 for v in smoothed)
    assert max(smoothed[10:]) - min(smoothed[10:]) < 10.0  # the zig-zag is damped
    assert ema([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]  # too short to smooth


def test_constant_series_fold_unless_they_vary_in_some_run(tmp_path):
    a = load_run(rl_run(tmp_path / "a"))
    b = load_run(rl_run(tmp_path / "b"))
    b.series["sync/tensors"].values[3] = 30.0
    plotted, folded = split_constant([a], ["sync/tensors", "train/loss", "time/startup/ray_s"])
    assert plotted == ["train/loss"] and folded == ["sync/tensors", "time/startup/ray_s"]
    assert split_constant([a, b], ["sync/tensors"]) == (["sync/tensors"], [])


def test_funnel_of_a_fully_async_run(tmp_path):
    run = load_run(rl_run(tmp_path / "a", steps=30))
    # produced 30 × 30, zero-variance 8 × 30, stale 6 × 30 − 2, 2 left in the buffer: 30 steps × 16 groups trained
    assert funnel(run) == [("produced", 900.0), ("dropped: zero-variance", 240.0), ("dropped: stale", 178.0),
                           ("left in the buffer", 2.0), ("trained on", 480.0)]


def test_funnel_of_a_sync_run_sums_per_step_counts():
    records = [{"step": s, "rollout/launched_groups": 20.0, "rollout/kept_groups": 16.0, "rollout/filtered_groups": 3.0,
                "rollout/failed_groups": 0.0, "rollout/aborted_groups": 1.0} for s in range(1, 4)]
    run = Run("s", None, records, build_series(records), {}, {"rollout": {"dynamic_filter": None}})
    assert funnel(run) == [("produced", 60.0), ("dropped: filtered", 9.0), ("dropped: aborted or surplus", 3.0),
                           ("trained on", 48.0)]


def test_funnel_is_none_without_rollout_counts(tmp_path):
    assert funnel(load_run(sft_run(tmp_path / "sft"))) is None


def test_time_breakdown_splits_train_from_old_logprobs_and_keeps_the_rest(tmp_path):
    run = load_run(rl_run(tmp_path / "a", steps=10))
    parts = time_breakdown(run)
    assert list(parts) == ["wait for data", "old logprobs", "train", "weight sync", "eval", "other"]
    assert parts["train"][3] == pytest.approx(0.4) and parts["other"][3] == pytest.approx(0.7 - 0.1 - 0.5 - 0.05)
    assert set(parts["eval"]) == {0, 10}
    assert startup_phases(run) == {"ray": 5.0, "engines": 8.0, "total": 13.0}
    assert list(time_breakdown(load_run(sft_run(tmp_path / "sft")))) == ["eval", "train step"]


def test_samples_per_s_of_rollout_and_train(tmp_path):
    rates = samples_per_s(load_run(rl_run(tmp_path / "a", steps=5)))
    assert rates["rollout"].values == pytest.approx([240.0] * 4)  # 240 samples a second
    assert rates["train"].values == pytest.approx([128 / 0.7] * 5)  # 16 groups × 8 per 0.7 s step


def test_samples_reader_skips_bad_lines_and_picks_first_middle_last(tmp_path):
    rl_run(tmp_path / "a", steps=30)
    with (tmp_path / "a" / "samples.jsonl").open("a") as f:
        f.write('{"step": 31, "prompt": "half a li\n[1, 2]\n')
    by_step = read_samples(tmp_path / "a")
    assert sorted(by_step) == [1, 15, 30] and len(by_step[15]) == 40
    assert pick_steps([1, 2, 3, 4, 5]) == [1, 3, 5] and pick_steps([7, 9]) == [7, 9]
    shown = examples(by_step[1], prompts=3, responses=4)
    assert [e["prompt"] for e in shown] == ["What is 0 + 1?", "What is 1 + 1?", "What is 2 + 1?"]
    assert [r["reward"] for r in shown[0]["responses"]] == [1.0, 0.0, 1.0, 0.0]
    assert examples([{"step": 1, "prompt": [{"role": "user", "content": "hi"}], "response": "yo", "reward": 1}])[0][
        "prompt"] == "user: hi"


def _sample(i: int, reward: float) -> Sample:
    return Sample(tokens=[1, 2, 3], response_length=1, loss_mask=[1], rollout_logprobs=[-0.5], reward=reward,
                  status=Status.COMPLETED, weight_versions=["4"], group_index=i // 2, index=i, label="7",
                  prompt=f"p{i // 2}", response=f"r{i}")


def test_samples_writer_and_rollout_dumps_read_back(tmp_path):
    samples = [_sample(i, float(i % 2)) for i in range(4)]
    append_samples(tmp_path, 3, samples)
    assert read_samples(tmp_path)[3][1] == sample_record(samples[1], 3)
    assert sample_record(samples[1], 3) == {"step": 3, "prompt": "p0", "response": "r1", "reward": 1.0, "label": "7",
                                            "group": 0, "status": "completed", "weight_version": 4,
                                            "response_tokens": 1}
    samples[0].metadata["outcome"] = "tests 0/1; 2 tool calls, ended by answer\nPASSED 0/1"  # an agent's episode
    assert sample_record(samples[0], 3)["outcome"] == samples[0].metadata["outcome"]
    dumps = tmp_path / "dumps"
    for step in (0, 1, 2, 5):
        dump_batch(RolloutBatch([samples[:2], samples[2:]], {}), dumps / f"rollout_{step:06d}.samples")
    by_step = read_samples(tmp_path / "none", dump_dir=dumps)
    assert sorted(by_step) == [0, 2, 5] and by_step[5][3]["response"] == "r3"


def test_rl_report_sections_in_order_once_each_with_units_and_samples(tmp_path):
    page = write_report(rl_run(tmp_path / "a")).read_text()
    assert headings(page) == ["Overview", "Where the time goes", "Where the data goes", "Sample generations",
                              "Everything else", "Config"]
    assert "Plotly.newPlot" in page and not re.search(r"<(script|img|link)[^>]*(src|href)=", page)  # self-contained
    figures = figures_of(page)
    assert {"score-steps", "score-time", "reward", "tokens-per-s", "samples-per-s", "time-steps", "startup",
            "funnel", "staleness", "m-train-grad_norm"} <= set(figures)
    assert figures["score-steps"]["data"][0]["y"][-1] == pytest.approx(80.0)  # % on the axis
    assert figures["m-train-grad_norm"]["data"][0]["opacity"] == 0.25  # the raw series, faint behind the EMA
    assert not any(k.startswith(("m-sync-tensors", "m-time-startup", "m-rollout-reward_mean")) for k in figures)
    assert "<td>sync/tensors</td><td class=\"num\">24</td>" in page  # folded into the constants table
    assert "50.0% → 80.0%" in page and "+30.0 points" in page
    assert page.count("<h3>Step ") == 3 and "What is 0 + 30?" in page
    assert "<small>outcome</small><pre>tests 0/1</pre>" in page and page.count("<small>outcome</small>") == 3 * 4


def test_sft_report_has_no_rollout_sections_and_links_to_the_rl_run(tmp_path, capsys):
    sft = sft_run(tmp_path / "sft")
    page = write_report(sft).read_text()
    assert headings(page) == ["Overview", "Where the time goes", "Everything else", "Config"]
    assert "loss" in figures_of(page) and "m-train-loss" not in figures_of(page) and "RL runs started" not in page
    rl = rl_run(tmp_path / "rl", model=str(tmp_path / "elsewhere" / "sft" / "hf"))  # moved: found by name
    rl_page = write_report(rl).read_text()
    assert 'started from the model of SFT run <a href="../sft/report.html">sft</a>' in rl_page
    assert 'RL runs started from this run\'s model: <a href="../rl/report.html">rl</a>' in (sft / "report.html").read_text()


def test_overlay_report_draws_each_run_in_its_colour(tmp_path, capsys):
    a, b = rl_run(tmp_path / "sync", schedule="sync"), rl_run(tmp_path / "async", steps=20)
    write_report(a)
    out = tmp_path / "cmp.html"
    assert main(["report", str(a), str(b), "--out", str(out)]) == 0
    assert str(out) in capsys.readouterr().out
    page = out.read_text()
    assert headings(page) == ["Overview", "Where the time goes", "Where the data goes", "Everything else", "Config"]
    figures = figures_of(page)
    names = [t["name"] for t in figures["score-steps"]["data"]]
    colours = {t["name"]: t["line"]["color"] for t in figures["score-steps"]["data"]}
    assert names == ["sync", "async"] and colours["sync"] != colours["async"]
    assert [t["name"] for t in figures["funnel"]["data"]] == ["sync", "async"]
    assert figures["time-mean"]["data"][0]["y"] == ["sync", "async"]
    assert '<a href="sync/report.html">sync</a>' in page and "<th>sync</th><th>async</th>" in page


def test_overlay_names_runs_apart_and_refuses_missing_dirs(tmp_path, capsys):
    a, b = rl_run(tmp_path / "x" / "run"), rl_run(tmp_path / "y" / "run")
    page = write_compare_report([a, b], tmp_path / "o.html").read_text()
    assert [t["name"] for t in figures_of(page)["score-steps"]["data"]] == ["x/run", "y/run"]
    assert main(["report", str(a), str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_stale_drops_by_length_reads_the_last_count_of_each_bucket():
    records = [{"step": 1, "buffer/dropped_stale_len_le_128_total": 1.0, "buffer/dropped_stale_len_le_8_total": 0.0},
               {"step": 2, "buffer/dropped_stale_len_le_128_total": 3.0, "buffer/dropped_stale_len_le_8_total": 1.0}]
    run = Run("s", None, records, build_series(records), {}, {})
    assert stale_drops_by_length(run) == [(8, 1.0), (128, 3.0)]
