"""The coding environment (examples/coding/) through the real session server and bubblewrap sandboxes, over a
scripted engine: a model that writes the solution and runs the tests earns 1.0, one that does nothing the
task's starting grade; tool results reach the model as tool messages; the sandbox is closed whatever the
episode's end, and a group shares one when the recipe says so; the token accounting holds; the teacher's
transcripts, replayed, solve every task."""

import asyncio
import json

import pytest

from examples.coding.make_data import make_data, split_problems, task_problem
from examples.coding.reward import pass_fraction
from examples.coding.teacher import FINAL_ANSWER, teacher_steps
from examples.coding.tool_template import with_tool_template
from examples.coding.tools import TOOL_NAMES
from tests.agent_accounting import assert_engine_tokens
from tests.component.test_calculator_agent import gold_script
from verst.config import ConfigError, VerstConfig
from verst.config.registries import SANDBOX_PROVIDERS
from verst.config.registry import Entry
from verst.data.loading import load_prompts
from verst.inference_client.client import EngineClient
from verst.models import load_tokenizer
from verst.models.tokenizer import save_tokenizer
from verst.rewards import RewardError
from verst.rollout import RolloutContext, generate_and_reward
from verst.rollout.agentic import SANDBOXES_KEY
from verst.sandbox import BubblewrapProvider, SandboxPool
from verst.sandbox.coding_tasks import generate, grade
from verst.session.manager import MISMATCH_KEY
from verst.session.scripted import ScriptedEngine
from verst.types import Sample, Status

CFG = VerstConfig.model_validate({
    "rollout": {"generate_fn": "verst.rollout.agentic:generate", "agent_fn": "examples.coding.agent:run",
                "max_response_tokens": 512, "max_context_tokens": 8192, "max_prompt_tokens": 8192},
    "reward": {"type": "custom", "path": "examples.coding.reward:pass_fraction"},
    "sandbox": {"provider": "local"},
})


class RecordingProvider:
    """The local provider, remembering every sandbox it started (to check each is closed)."""

    def __init__(self):
        self.inner, self.started = BubblewrapProvider(), []

    def start(self, files):
        self.started.append(self.inner.start(files))
        return self.started[-1]


@pytest.fixture
def provider():
    return RecordingProvider()


def problem_sample(problem, index=0):
    return Sample(prompt=problem.to_row()["prompt"], label=problem.label, metadata=problem.metadata, index=index,
                  group_index=index)


def task_sample(task, index=0):
    return problem_sample(task_problem(task, None), index)


def call(name, **arguments):
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def run_episodes(tok, engine, samples, cfg=CFG, pool=None):
    """The samples' episodes at once against `engine`, with the sandboxes `cfg` names or those of `pool`."""
    async def main():
        async with EngineClient("http://scripted-engine", transport=engine) as client:
            ctx = RolloutContext.from_config(cfg, client, tok, source=None)
            if pool is not None:
                ctx.resources[SANDBOXES_KEY] = pool
            try:
                return await asyncio.gather(*(generate_and_reward(ctx, sample) for sample in samples))
            finally:
                await ctx.aclose()

    return asyncio.run(main())


def run_episode(tok, script, sample, provider, engine=None):
    """One episode, its sandbox from `provider` (each trajectory its own)."""
    engine = engine or ScriptedEngine(tok, script, context_length=16384)
    [done] = run_episodes(tok, engine, [sample], pool=SandboxPool(provider, "trajectory", group_size=1))
    return done, engine


def test_writing_the_solution_and_running_the_tests_earns_one(tok, provider):
    task = generate("train", 1, seed=5)[0]
    script = [call("edit_file", path="project.py", content=task.solution["project.py"]),
              call("shell", command="python3 run_tests.py"), "Done."]
    done, engine = run_episode(tok, script, task_sample(task), provider)
    assert done.status is Status.COMPLETED and done.reward == 1.0
    meta = done.metadata
    assert (meta["pass_fraction"], meta["tests_passed"], meta["tests_total"]) == (1.0, 4, 4)
    assert (meta["checks_passed"], meta["checks_total"]) == (4, 4)
    assert meta["outcome"].startswith("tests 4/4, hidden checks 4/4; 2 tool calls, ended by answer\n")
    assert meta["outcome"].endswith("PASSED 4/4")
    assert meta["commands"] == [{"command": "python3 run_tests.py", "exit_code": 0, "output": "PASSED 4/4\n"}]
    assert (meta["agent_turns"], meta["tool_calls"], meta["tool_errors"], meta["agent_end"]) == (3, 2, 0, "answer")
    # each tool result reached the model as a tool message in the next call's prompt, out of the loss
    second, third = (tok.decode(c.input_ids) for c in engine.calls[1:])
    assert f"wrote {len(task.solution['project.py'])} characters to project.py" in second
    assert "exit code 0\nPASSED 4/4" in third and "exit code 0" not in second
    assert_engine_tokens(done, engine.calls)
    assert done.metadata[MISMATCH_KEY] == []  # the canonical re-render of the conversation gives the same ids
    assert [box.closed for box in provider.started] == [True]


def test_a_model_that_does_nothing_gets_the_starting_grade(tok, provider):
    tasks = generate("train", 8, seed=2)
    starting = []
    for task in tasks:
        box = BubblewrapProvider().start(task.files)
        try:
            starting.append(grade(box, task.checks))
        finally:
            box.close()
    assert 0.0 in starting
    for i, (task, expected) in enumerate(zip(tasks, starting)):
        done, _ = run_episode(tok, ["I am done."], task_sample(task, i), provider)
        assert done.reward == expected and done.metadata["commands"] == []
    assert len(provider.started) == len(tasks) and all(box.closed for box in provider.started)


def test_rewriting_the_tests_does_not_pass_them(tok, provider):
    task = generate("train", 1, seed=5)[0]
    fake = "print('PASSED 4/4')\n"
    done, _ = run_episode(tok, [call("edit_file", path="run_tests.py", content=fake),
                                call("shell", command="python3 run_tests.py"), "Done."], task_sample(task), provider)
    assert done.metadata["commands"][0]["output"] == "PASSED 4/4\n"  # the model fooled itself
    assert done.reward < 1.0 and done.metadata["tests_total"] == 4  # the grade ran the task's own runner


def test_printing_the_verdict_from_the_project_does_not_pass_the_hidden_checks(tok, provider):
    task = generate("train", 1, seed=5)[0]
    fake = "import os\nprint('PASSED 4/4', flush=True)\nos._exit(0)\n"
    done, _ = run_episode(tok, [call("edit_file", path="project.py", content=fake), "Done."], task_sample(task),
                          provider)
    assert done.metadata["tests_passed"] == 4  # the visible runner is fooled
    assert done.metadata["checks_passed"] == 0 and done.reward == 0.0  # the grade is not


def test_refused_calls_are_reported_to_the_model(tok, provider):
    task = generate("train", 1, seed=5)[0]
    done, engine = run_episode(tok, [call("read_file", path="../etc/passwd"), call("delete", path="a"),
                                     call("shell", cmd="ls"), "Done."], task_sample(task), provider)
    assert done.metadata["tool_errors"] == 3 and done.status is Status.COMPLETED
    last = tok.decode(engine.calls[-1].input_ids)
    assert "outside the workspace" in last and "unknown tool 'delete'" in last and "exactly command" in last


def test_the_sandbox_is_closed_when_the_episode_fails(tok, provider):
    class Everyone(set):
        def __contains__(self, key):
            return True

    task = generate("train", 1, seed=5)[0]
    engine = ScriptedEngine(tok, ["Done."], context_length=16384)
    engine.down = Everyone()  # every engine call fails, so the agent's first completion raises
    done, _ = run_episode(tok, None, task_sample(task), provider, engine)
    assert done.status is Status.ABORTED
    assert len(provider.started) == 1 and provider.started[0].closed and not provider.started[0].workspace.exists()


@pytest.mark.parametrize("split, family, tools", [("train", "operations", TOOL_NAMES),
                                                  ("heldout", "operations", TOOL_NAMES),
                                                  ("heldout", "operators", ("shell", "edit_file"))])
def test_the_teachers_transcripts_replayed_solve_every_task(tok, provider, split, family, tools):
    problems = split_problems(split, 4, seed=1, family=family, tools=tools)
    for i, problem in enumerate(problems):
        assert [tool["function"]["name"] for tool in problem.metadata["tools"]] == list(tools)
        sample = problem_sample(problem, i)
        script, ids, mask = gold_script(tok, sample)
        assert script[-1] == FINAL_ANSWER
        done, engine = run_episode(tok, script, sample, provider)
        assert done.reward == 1.0 and done.metadata["agent_end"] == "answer"
        assert done.tokens == ids and done.loss_mask == mask  # what SFT teaches is what RL trains on
        assert_engine_tokens(done, engine.calls)
        assert done.metadata[MISMATCH_KEY] == []
    assert all(box.closed for box in provider.started)


@pytest.mark.parametrize("lifetime, started", [("trajectory", 2), ("group", 1)])
def test_the_recipe_chooses_the_provider_by_name_and_a_group_may_share_one_sandbox(tok, registries_restored,
                                                                                  lifetime, started):
    recording = RecordingProvider()
    SANDBOX_PROVIDERS.add("recording", Entry(lambda: recording, "the local provider, recorded"))
    cfg = VerstConfig.model_validate({**CFG.model_dump(exclude_unset=True),
                                      "sandbox": {"provider": "recording", "lifetime": lifetime}})
    cfg.rollout.n_samples_per_prompt = 2
    task = generate("train", 1, seed=5)[0]
    engine = ScriptedEngine(tok, [call("edit_file", path="project.py", content=task.solution["project.py"]),
                                  call("shell", command="python3 run_tests.py"), "Done."], context_length=16384)
    samples = [task_sample(task, 0), task_sample(task, 1)]
    samples[1].group_index = 0  # one group of two episodes, at once
    done = run_episodes(tok, engine, samples, cfg)
    assert [d.reward for d in done] == [1.0, 1.0] and all(d.metadata["tests_total"] == 4 for d in done)
    assert len(recording.started) == started and all(box.closed for box in recording.started)


def test_an_agent_fn_without_a_sandbox_parameter_is_refused_with_a_provider(tok):
    cfg = CFG.model_copy(update={"rollout": CFG.rollout.model_copy(
        update={"agent_fn": "examples.calculator.agent:run"})})
    with pytest.raises(ConfigError, match=r"sandbox.provider = 'local'.*add a `sandbox` parameter"):
        RolloutContext.from_config(cfg, None, tok, source=None)


def test_sandbox_settings_are_checked_when_the_config_loads():
    with pytest.raises(ValueError, match=r"sandbox.provider.*'docker'.*local"):
        VerstConfig.model_validate({"sandbox": {"provider": "docker"}})
    with pytest.raises(ValueError, match=r"sandbox.provider = 'local' hands each episode's sandbox to the agent fn"):
        VerstConfig.model_validate({"sandbox": {"provider": "local"}})
    with pytest.raises(ValueError, match="lifetime"):
        VerstConfig.model_validate({"sandbox": {"lifetime": "episode"}})


def test_a_sample_without_its_files_fails_its_episode_naming_the_key(tok, provider):
    task = generate("train", 1, seed=5)[0]
    sample = task_sample(task)
    sample.metadata = {k: v for k, v in sample.metadata.items() if k != "files"}
    done, _ = run_episode(tok, ["Done."], sample, provider)
    assert done.status is Status.ABORTED and "sandbox.files_key = 'files'" in done.metadata["generate_error"]
    assert provider.started == []


def test_the_data_rows_load_as_prompts_with_the_task_in_their_metadata(tmp_path):
    paths = make_data(tmp_path, n_train=3, n_test=2, seed=4)
    train, test = load_prompts(paths["train"]), load_prompts(paths["test"])
    assert len(train) == 3 and len(test) == 2
    tasks = generate("train", 3, seed=4)
    for sample, task in zip(train, tasks):
        text = sample.prompt[0]["content"]
        assert text.startswith(task.prompt) and "project.py, run_tests.py, test_project.py" in text
        assert sample.metadata["files"] == task.files and sample.metadata["test_files"] == ["run_tests.py",
                                                                                          "test_project.py"]
        assert sample.metadata["conversation"][-1] == {"role": "assistant", "content": FINAL_ANSWER}
    assert {s.metadata["name"].split("-")[1] for s in test} == {"maximum"}  # the held-out operation


def test_a_teacher_taking_the_shortcut_writes_the_fix_without_reading_the_tests():
    task = generate("train", 1, family="operators")[0]
    steps = teacher_steps(task, ("shell", "edit_file"))
    assert [name for name, _ in steps] == ["shell", "edit_file", "shell"]
    assert steps[0] == ("shell", {"command": "cat test_project.py"})
    assert steps[1][1] == {"path": "project.py", "content": task.solution["project.py"]}
    assert teacher_steps(task, TOOL_NAMES)[0] == ("read_file", {"path": "test_project.py"})
    assert teacher_steps(task, ("shell", "edit_file"), shortcut=True) == steps[1:]
    problems = split_problems("train", 40, family="operators", tools=("shell", "edit_file"), shortcut=0.5)
    first_calls = [p.metadata["conversation"][0]["tool_calls"][0]["function"]["name"] for p in problems]
    assert 12 <= first_calls.count("edit_file") <= 28  # seeded: one in two on average
    for tools, shortcut in [(("shell",), 0.0), (("shell", "edit_file", "browse"), 0.0), (TOOL_NAMES, 1.5)]:
        with pytest.raises(ValueError, match=r"tools|shortcut 1.5"):
            split_problems("train", 1, tools=tools, shortcut=shortcut, with_teacher=False)


def test_a_teacher_takes_the_shortcut_on_the_functions_it_knows_only():
    familiar = ("blend", "combine")
    problems = split_problems("train", 60, family="operators", tools=("shell", "edit_file"), shortcut=1.0,
                              familiar=familiar)
    functions = [p.metadata["name"].split("-")[1] for p in problems]
    shortcuts = [p.metadata["conversation"][0]["tool_calls"][0]["function"]["name"] == "edit_file" for p in problems]
    assert 0 < sum(shortcuts) < len(problems)
    assert shortcuts == [function in familiar for function in functions]
    with pytest.raises(ValueError, match=r"familiar.*\['blend', 'sum'\].*\['sum'\] name no function"):
        split_problems("train", 1, family="operators", familiar=("blend", "sum"), with_teacher=False)


def test_the_reward_needs_the_agents_grade():
    assert asyncio.run(pass_fraction(Sample(prompt="p", metadata={"pass_fraction": 0.75}))) == 0.75
    with pytest.raises(RewardError, match="no 'pass_fraction'.*examples.coding.agent:run"):
        asyncio.run(pass_fraction(Sample(prompt="p", metadata={})))


def test_the_tool_template_copy_renders_tools_and_tool_calls(tmp_path, tok):
    source = save_tokenizer(tmp_path / "plain", "{% for m in messages %}{{ m.content }}{% endfor %}")
    copy = load_tokenizer(with_tool_template(source, tmp_path / "tools"))
    problem = split_problems("train", 1)[0]
    text = copy.apply_chat_template([*problem.to_row()["prompt"], *problem.metadata["conversation"]],
                                    tools=problem.metadata["tools"], tokenize=False)
    assert '"name": "edit_file"' in text and '<tool_call>\n{"name": "shell"' in text and "PASSED 4/4" in text
