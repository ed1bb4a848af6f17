"""The run progress display: one line per step off a terminal, a live bar on one, silence when off."""

import io

import pytest

from verst.monitor.progress import RunProgress, headline


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_headline_formats_present_metrics_and_skips_missing_or_nan():
    text = headline({"rollout/reward_mean": 0.5, "train/loss": float("nan"), "eval/accuracy": 0.615,
                     "perf/step_time_s": 1.234})
    assert text == "reward 0.500, eval 61.5%, step 1.23 s"


def test_lines_mode_prints_every_nth_step_the_last_and_eval_steps():
    out = io.StringIO()
    with RunProgress("sync", 5, stream=out, line_every=2) as progress:
        for step in range(1, 6):
            progress.step(step, {"rollout/reward_mean": step / 10, **({"eval/accuracy": 0.25} if step == 3 else {})})
    lines = out.getvalue().splitlines()
    assert progress.mode == "lines"
    assert lines == ["[sync] step 2/5: reward 0.200", "[sync] step 3/5: reward 0.300, eval 25.0%",
                     "[sync] step 4/5: reward 0.400", "[sync] step 5/5: reward 0.500"]


def test_live_mode_on_a_terminal_shows_the_bar_with_the_last_eval():
    out = Terminal()
    with RunProgress("fully_async", 4, stream=out) as progress:
        progress.step(1, {"rollout/reward_mean": 0.1, "eval/accuracy": 0.4})
        progress.step(4, {"rollout/reward_mean": 0.9})
    assert progress.mode == "live"
    text = out.getvalue()
    assert "fully_async" in text and "4/4" in text and "eval 40.0%" in text and "reward 0.900" in text


def test_off_mode_writes_nothing_and_bad_arguments_are_refused():
    out = io.StringIO()
    with RunProgress("sync", 2, mode="off", stream=out) as progress:
        progress.step(1, {"rollout/reward_mean": 1.0})
    assert out.getvalue() == ""
    with pytest.raises(ValueError, match="mode must be"):
        RunProgress("sync", 2, mode="fancy")
    with pytest.raises(ValueError, match="line_every must be >= 1, got 0"):
        RunProgress("sync", 2, line_every=0)


def test_agent_success_is_shown_and_kept_until_the_next_evaluation():
    out = io.StringIO()
    with RunProgress("sft", 3, stream=out, line_every=1) as progress:
        progress.step(1, {"train/loss": 0.5, "eval/success": 0.25})
        progress.step(2, {"train/loss": 0.4})
    assert out.getvalue().splitlines() == ["[sft] step 1/3: loss 0.5000, success 25.0%", "[sft] step 2/3: loss 0.4000"]
    assert headline({"train/loss": 0.4}, progress.last_eval) == "loss 0.4000, success 25.0%"
